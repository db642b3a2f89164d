//! Opaque handles. Every object the ABI hands out is an `Arc` whose address is the handle;
//! a registry per type holds the live ones, so that every entry point can refuse a NULL, a
//! handle freed already or a pointer of another kind before it touches memory.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use isthmus::{Code, Status};

/// The live handles of one type.
pub(crate) struct Registry<T> {
    what: &'static str,
    live: Mutex<BTreeMap<usize, Arc<T>>>,
}

impl<T> Registry<T> {
    pub(crate) const fn new(what: &'static str) -> Registry<T> {
        Registry { what, live: Mutex::new(BTreeMap::new()) }
    }

    /// Registers `value`; its handle.
    pub(crate) fn insert(&self, value: Arc<T>) -> *mut T {
        let handle = Arc::as_ptr(&value).cast_mut();
        if let Ok(mut live) = self.live.lock() {
            live.insert(handle as usize, value);
        }
        handle
    }

    /// [`insert`](Self::insert) for a value not yet shared.
    pub(crate) fn add(&self, value: T) -> *mut T {
        self.insert(Arc::new(value))
    }

    /// The object behind `handle`, if it is a live handle of this type.
    pub(crate) fn get(&self, handle: *const T) -> Result<Arc<T>, Status> {
        if handle.is_null() {
            return Err(invalid(format!("the {} is NULL", self.what)));
        }
        let live = self.live.lock().map_err(|_| invalid("handle registry poisoned"))?;
        live.get(&(handle as usize)).cloned().ok_or_else(|| self.stale())
    }

    /// Unregisters `handle`: the object lives on only while something else holds it.
    pub(crate) fn remove(&self, handle: *const T) -> Result<Arc<T>, Status> {
        if handle.is_null() {
            return Err(invalid(format!("the {} is NULL", self.what)));
        }
        let mut live = self.live.lock().map_err(|_| invalid("handle registry poisoned"))?;
        live.remove(&(handle as usize)).ok_or_else(|| self.stale())
    }

    /// The number of live handles of this type.
    pub(crate) fn len(&self) -> usize {
        self.live.lock().map_or(0, |live| live.len())
    }

    fn stale(&self) -> Status {
        invalid(format!("not a live {} handle (freed already, or not one)", self.what))
    }
}

/// A refused handle, as every entry point reports one.
fn invalid(what: impl Into<String>) -> Status {
    Status::new(Code::InvalidArgument, what)
}
