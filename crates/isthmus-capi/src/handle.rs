//! Opaque handles. Every object the ABI hands out is an `Arc` kept in a registry per type,
//! under a handle value minted for it, so that every entry point can refuse a NULL, a handle
//! freed already or a pointer of another kind before it touches memory.
//!
//! The values are addresses in a range of address space reserved with no access: nothing is
//! ever mapped there, so a value is no object's address (a garbage collector that scans the
//! caller's memory, as Go's does, takes it for none of its own, and a C caller that dereferences
//! one faults at once), and a value is not handed out again until 2^36 handles later (2^28 in
//! the smaller range). A handle freed twice is refused even when other handles were made in
//! between: an object's own address, the handle this used to be, came back from the allocator
//! for the next object of its size at once, so the second free freed that one. Where the range
//! cannot be reserved (an address-space limit), handles fall back to the objects' addresses.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

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

    /// The live handles, even if a thread panicked holding them: every change under this lock
    /// is one insert or removal, so none is left half made, and refusing the lock would drop
    /// every object registered after (a server call among them, left to its deadline).
    fn live(&self) -> std::sync::MutexGuard<'_, BTreeMap<usize, Arc<T>>> {
        self.live.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Registers `value`; its handle.
    pub(crate) fn insert(&self, value: Arc<T>) -> *mut T {
        let mut live = self.live();
        let handle = loop {
            let (handle, wrapped) = match handle_values() {
                Some(values) => values.next(),
                None => (Arc::as_ptr(&value) as usize, false),
            };
            // Past a wrap of the range, a value still live in this registry is passed over.
            if !wrapped || !live.contains_key(&handle) {
                break handle;
            }
        };
        live.insert(handle, value);
        handle as *mut T
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
        self.live().get(&(handle as usize)).cloned().ok_or_else(|| self.stale())
    }

    /// Unregisters `handle`: the object lives on only while something else holds it.
    pub(crate) fn remove(&self, handle: *const T) -> Result<Arc<T>, Status> {
        if handle.is_null() {
            return Err(invalid(format!("the {} is NULL", self.what)));
        }
        self.live().remove(&(handle as usize)).ok_or_else(|| self.stale())
    }

    /// The number of live handles of this type.
    pub(crate) fn len(&self) -> usize {
        self.live().len()
    }

    fn stale(&self) -> Status {
        invalid(format!("not a live {} handle (freed already, or not one)", self.what))
    }
}

/// The reserved range handle values come from, 16 bytes apart.
struct HandleValues {
    base: usize,
    slots: usize,
    next: AtomicUsize,
}

const HANDLE_STEP: usize = 16;

impl HandleValues {
    /// The next value, and whether the range has wrapped (the value may be live still).
    fn next(&self) -> (usize, bool) {
        let n = self.next.fetch_add(1, Ordering::Relaxed);
        (self.base + (n % self.slots) * HANDLE_STEP, n >= self.slots)
    }
}

/// The process's handle range, reserved on first use: 1 TiB of address space, or 4 GiB where
/// that is refused; none where both are.
fn handle_values() -> Option<&'static HandleValues> {
    static VALUES: OnceLock<Option<HandleValues>> = OnceLock::new();
    VALUES
        .get_or_init(|| {
            [1usize << 40, 1 << 32].into_iter().find_map(|len| {
                // SAFETY: an anonymous private mapping with no access at an address the kernel
                // picks; it touches no existing memory. It is never unmapped (handles live as
                // long as the library), and nothing reads or writes through it.
                let at = unsafe {
                    libc::mmap(
                        std::ptr::null_mut(),
                        len,
                        libc::PROT_NONE,
                        libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                        -1,
                        0,
                    )
                };
                (at != libc::MAP_FAILED).then(|| HandleValues {
                    base: at as usize,
                    slots: len / HANDLE_STEP,
                    next: AtomicUsize::new(0),
                })
            })
        })
        .as_ref()
}

/// A refused handle, as every entry point reports one.
fn invalid(what: impl Into<String>) -> Status {
    Status::new(Code::InvalidArgument, what)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Freed, then another made (which the allocator gives the freed object's block), then
    /// freed again: the second free is refused and the new handle is left alone. With handles
    /// that were addresses, the new one had the first one's value and the second free took it.
    /// (The C check of the same runs under AddressSanitizer, whose quarantine delays the reuse.)
    #[test]
    fn a_handle_freed_twice_is_refused_after_another_was_made() {
        let r: Registry<[u8; 40]> = Registry::new("test");
        assert!(handle_values().is_some(), "the handle range is reserved here");
        let first = r.add([1; 40]);
        r.remove(first).expect("live");
        let second = r.add([2; 40]);
        assert_ne!(first, second, "a freed handle's value handed out again at once");
        assert!(r.remove(first).is_err(), "a second free of the first");
        assert_eq!(*r.get(second).expect("the new handle"), [2; 40]);
        r.remove(second).expect("live");
    }

    /// A thread that panicked holding the registry's lock leaves it usable: a handle made
    /// after is registered and found. Refused, the lock dropped every object registered after
    /// (a server call among them, left to its deadline) and found no live handle.
    #[test]
    fn a_registry_poisoned_by_a_panic_goes_on() {
        let r: Registry<u32> = Registry::new("test");
        let before = r.add(1);
        let poisoned = std::thread::scope(|s| {
            s.spawn(|| {
                let _live = r.live.lock();
                panic!("a panic holding the registry's lock");
            })
            .join()
        });
        assert!(poisoned.is_err() && r.live.is_poisoned(), "the lock is poisoned");
        let after = r.add(2);
        assert_eq!((*r.get(before).expect("made before"), *r.get(after).expect("made after")), (1, 2));
        assert_eq!(r.len(), 2);
        r.remove(before).expect("live");
        r.remove(after).expect("live");
    }
}
