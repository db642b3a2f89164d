//! Messages as Python buffers, for the raw tier: nothing is copied into a Python `bytes`.
//!
//! - [`Message`]: a received message as a read-only buffer. A large message (one that came
//!   through the sender's arena) is a view of shared memory; the `Message`, and every
//!   `memoryview` or numpy array made from it (each holds a reference to it), keeps that block
//!   from its sender until the last of them is gone. Small messages travel inline in the ring
//!   and are copied once, into memory of their own; so are a server's requests that came over
//!   HTTP/2 (its loopback copies what it receives, ADR 0036). A view of shared memory is
//!   memory the sender maps writable: an honest one leaves it alone until it is given back,
//!   but a hostile one could change it under its reader (ADR 0003, "The one exception"), so a
//!   handler that checks a message before it uses it checks a copy (`bytes(message)`).
//! - [`Block`]: a writable buffer to send a message from, filled in place: a block of this
//!   side's shared memory over `shm://` (the receiver reads it where it is), heap memory on
//!   other transports (copied when sent). A block is sent once; sending it while a view of it
//!   is still exported (a `memoryview`, a numpy array) raises `BufferError`, so no Python code
//!   can write into memory the receiver is reading.
//! - [`Request`]: any object with the buffer protocol (bytes, bytearray, memoryview, numpy
//!   arrays) as bytes to send, without a copy into Python: the export is held while the
//!   message is copied into the ring or arena, with the GIL released, so another thread must
//!   not write to that buffer meanwhile (the message would be torn). It must be C-contiguous;
//!   anything else raises `BufferError` (make it so with `numpy.ascontiguousarray`).
//!
//! This is the one module of the extension that hands memory to Python: the `unsafe` here
//! fills `Py_buffer` structs and reads exported buffers.

use std::ffi::c_int;

use bytes::Bytes;
use isthmus::BlockMut;
use pyo3::exceptions::{PyBufferError, PyValueError};
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::PyBytes;

/// A received message, as a read-only buffer (see the module's documentation).
#[pyclass(module = "isthmus._native", frozen, sequence)]
pub(crate) struct Message {
    bytes: Bytes,
}

impl Message {
    pub(crate) fn new(bytes: Bytes) -> Message {
        Message { bytes }
    }
}

#[pymethods]
impl Message {
    /// # Safety
    ///
    /// Called by Python with a `Py_buffer` to fill (the buffer protocol).
    unsafe fn __getbuffer__(slf: Bound<'_, Self>, view: *mut ffi::Py_buffer, flags: c_int) -> PyResult<()> {
        if flags & ffi::PyBUF_WRITABLE == ffi::PyBUF_WRITABLE {
            return Err(PyBufferError::new_err("a received message is read-only"));
        }
        let (ptr, len) = (slf.get().bytes.as_ptr(), slf.get().bytes.len());
        // SAFETY: `view` is the struct Python asked us to fill. The memory is the message's,
        // which stays mapped and in place while the `Message` lives (the view holds a reference
        // to it, its `obj`, for as long as it is exported); Python reads it as bytes, which any
        // value is, so a hostile sender that changes it meanwhile changes what is read, not
        // what is safe (the module's documentation).
        unsafe { fill_view(slf.as_any(), view, ptr.cast_mut(), len, true, flags) }
    }

    fn __len__(&self) -> usize {
        self.bytes.len()
    }

    /// A copy as `bytes`.
    fn tobytes<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, &self.bytes)
    }

    fn __repr__(&self) -> String {
        format!("<isthmus.Message of {} bytes>", self.bytes.len())
    }
}

/// Where a [`Block`]'s bytes live.
enum Memory {
    /// This side's arena (`shm://`).
    Shm(BlockMut),
    /// Heap memory, for transports without an arena.
    Heap(Vec<u8>),
    /// Sent: the block lends no more views, but its memory stays as long as the object. A tool
    /// may keep the address of a view it released at once while it keeps the object
    /// (`torch.frombuffer` does): its writes after the send must land in memory that is still
    /// there (the arena, or the bytes that were sent), not in memory freed or unmapped.
    Sent { _kept: Kept },
}

/// What a sent [`Block`] keeps of its memory: held, never read.
#[allow(dead_code)]
enum Kept {
    Mapping(isthmus::Mapping),
    Heap(Bytes),
}

/// A writable buffer to send one message from (see the module's documentation).
#[pyclass(module = "isthmus._native", sequence)]
pub(crate) struct Block {
    memory: Memory,
    /// Views exported and not yet released.
    exports: usize,
}

/// What a [`Block`] holds, taken out to be sent.
pub(crate) enum Outgoing {
    Shm(BlockMut),
    Heap(Bytes),
}

impl Block {
    pub(crate) fn shm(block: BlockMut) -> Block {
        Block { memory: Memory::Shm(block), exports: 0 }
    }

    /// `MemoryError` if the heap cannot hold `len` bytes. Zeroed by the allocator, lazily for a
    /// large block (fresh pages of the system are zero): a block of gigabytes, the heap's are
    /// the ones over the arena, took its memory and cleared it before the caller wrote a byte.
    pub(crate) fn heap(len: usize) -> PyResult<Block> {
        let refused = || pyo3::exceptions::PyMemoryError::new_err(format!("cannot allocate a block of {len} bytes"));
        if len == 0 {
            return Ok(Block { memory: Memory::Heap(Vec::new()), exports: 0 });
        }
        let layout = std::alloc::Layout::array::<u8>(len).map_err(|_| refused())?;
        // SAFETY: `layout` has a size above zero.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        if ptr.is_null() {
            return Err(refused());
        }
        // SAFETY: `ptr` comes from the global allocator with the layout of `len` bytes, all of
        // them initialised (zero); the Vec takes it over, with that length and capacity.
        let bytes = unsafe { Vec::from_raw_parts(ptr, len, len) };
        Ok(Block { memory: Memory::Heap(bytes), exports: 0 })
    }

    /// Whether this is a block of shared memory that `can_send` refuses (another channel's, or
    /// its connection's that is gone): checked before the block is taken, since a block taken
    /// is a block sent, and a retry of a call that sent nothing found it "already sent".
    pub(crate) fn refused_by(&self, can_send: impl Fn(&BlockMut) -> bool) -> bool {
        matches!(&self.memory, Memory::Shm(block) if !can_send(block))
    }

    /// Takes the bytes to send; `BufferError` if a view of them is still exported, or if the
    /// block was sent already.
    pub(crate) fn take(&mut self) -> PyResult<Outgoing> {
        if self.exports > 0 {
            return Err(PyBufferError::new_err(format!(
                "the block is still exported ({} view(s) of it, a memoryview or numpy array): release \
                 them (memoryview.release(), del) before sending it",
                self.exports
            )));
        }
        let (kept, outgoing) = match std::mem::replace(&mut self.memory, Memory::Heap(Vec::new())) {
            Memory::Shm(block) => (Kept::Mapping(block.mapping()), Outgoing::Shm(block)),
            Memory::Heap(bytes) => {
                // The same allocation, shared: no copy.
                let bytes = Bytes::from(bytes);
                (Kept::Heap(bytes.clone()), Outgoing::Heap(bytes))
            }
            sent @ Memory::Sent { .. } => {
                self.memory = sent;
                return Err(PyBufferError::new_err("the block was already sent"));
            }
        };
        self.memory = Memory::Sent { _kept: kept };
        Ok(outgoing)
    }
}

#[pymethods]
impl Block {
    /// # Safety
    ///
    /// Called by Python with a `Py_buffer` to fill (the buffer protocol).
    unsafe fn __getbuffer__(slf: Bound<'_, Self>, view: *mut ffi::Py_buffer, flags: c_int) -> PyResult<()> {
        let mut this = slf.try_borrow_mut().map_err(|_| PyBufferError::new_err("the block is in use"))?;
        let (ptr, len) = match &mut this.memory {
            Memory::Shm(block) => (block.as_mut_ptr(), block.len()),
            Memory::Heap(bytes) => (bytes.as_mut_ptr(), bytes.len()),
            Memory::Sent { .. } => return Err(PyBufferError::new_err("the block was sent: it can no longer be used")),
        };
        // SAFETY: `view` is the struct Python asked us to fill. The memory is the block's own
        // (no one else writes it until it is sent), and `take` refuses to send it while this
        // export lives; the view holds a reference to the `Block` meanwhile.
        unsafe { fill_view(slf.as_any(), view, ptr, len, false, flags) }?;
        this.exports += 1;
        Ok(())
    }

    /// # Safety
    ///
    /// Called by Python when a view from `__getbuffer__` is released.
    unsafe fn __releasebuffer__(&mut self, _view: *mut ffi::Py_buffer) {
        self.exports = self.exports.saturating_sub(1);
    }

    fn __len__(&self) -> usize {
        match &self.memory {
            Memory::Shm(block) => block.len(),
            Memory::Heap(bytes) => bytes.len(),
            Memory::Sent { .. } => 0,
        }
    }

    /// Shortens the block to `size` bytes before sending (a serializer that wrote less than it
    /// reserved). Not while a view is exported; a block never grows (ValueError, as the C ABI
    /// and Go refuse it).
    fn truncate(&mut self, size: usize) -> PyResult<()> {
        if self.exports > 0 {
            return Err(PyBufferError::new_err("the block is still exported: release its views first"));
        }
        let len = self.__len__();
        match &mut self.memory {
            Memory::Sent { .. } => return Err(PyBufferError::new_err("the block was already sent")),
            _ if size > len => {
                return Err(PyValueError::new_err(format!("cannot lengthen a block of {len} bytes to {size}")));
            }
            Memory::Shm(block) => block.truncate(size),
            Memory::Heap(bytes) => bytes.truncate(size),
        }
        Ok(())
    }

    /// Copies `data` (any C-contiguous buffer) into the block from `offset` on, as the transport
    /// copies a message: streaming stores for a large one, which leave the cache to the
    /// reader (ADR 0022), where `block[:] = data` would be a plain `memcpy`. `ValueError` if it
    /// does not fit, `BufferError` for a buffer that is not C-contiguous or a block already sent.
    #[pyo3(signature = (data, offset = 0))]
    fn write(&mut self, data: &Bound<'_, PyAny>, offset: usize) -> PyResult<()> {
        let data = Exported::get(data)?;
        let (ptr, len) = match &mut self.memory {
            Memory::Shm(block) => (block.as_mut_ptr(), block.len()),
            Memory::Heap(bytes) => (bytes.as_mut_ptr(), bytes.len()),
            Memory::Sent { .. } => return Err(PyBufferError::new_err("the block was already sent")),
        };
        let n = data.len();
        if offset.checked_add(n).is_none_or(|end| end > len) {
            return Err(PyValueError::new_err(format!(
                "{n} bytes at offset {offset} do not fit a block of {len} bytes"
            )));
        }
        // SAFETY: `offset + n <= len` (checked above), so the destination is `n` bytes of the
        // block, which `&mut self` keeps to this call; the source is the export's `n` bytes,
        // held by `data`. It may be a view of this very block: the two may overlap.
        unsafe { isthmus::move_into_shared(ptr.add(offset), data.ptr(), n) };
        Ok(())
    }

    /// True while the block lives in shared memory (so sending it copies nothing).
    #[getter]
    fn shared(&self) -> bool {
        matches!(self.memory, Memory::Shm(_))
    }

    fn __repr__(&self) -> String {
        match &self.memory {
            Memory::Shm(block) => format!("<isthmus.Block of {} bytes in shared memory>", block.len()),
            Memory::Heap(bytes) => format!("<isthmus.Block of {} bytes>", bytes.len()),
            Memory::Sent { .. } => "<isthmus.Block (sent)>".into(),
        }
    }
}

/// Fills `view` over `len` bytes at `ptr`, exported by `owner`.
///
/// # Safety
///
/// `view` must be the `Py_buffer` Python passed to `__getbuffer__`, and `ptr..ptr+len` must stay
/// valid (and, unless `readonly`, writable by Python alone) while `owner` lives.
unsafe fn fill_view(
    owner: &Bound<'_, PyAny>,
    view: *mut ffi::Py_buffer,
    ptr: *mut u8,
    len: usize,
    readonly: bool,
    flags: c_int,
) -> PyResult<()> {
    if view.is_null() {
        return Err(PyBufferError::new_err("no Py_buffer to fill"));
    }
    let len = ffi::Py_ssize_t::try_from(len).map_err(|_| PyValueError::new_err("message too large"))?;
    // SAFETY: per this function's contract; PyBuffer_FillInfo takes a new reference to `owner`
    // (released with the view) and honours `flags` (format, shape and strides when asked).
    let filled = unsafe { ffi::PyBuffer_FillInfo(view, owner.as_ptr(), ptr.cast(), len, c_int::from(readonly), flags) };
    if filled < 0 {
        return Err(PyErr::fetch(owner.py()));
    }
    Ok(())
}

/// A buffer exported by a Python object, held (and the object with it) until dropped.
pub(crate) struct Exported(Box<ffi::Py_buffer>);

impl Exported {
    /// `obj`'s buffer; `BufferError` unless it is C-contiguous (a 0-d array is).
    pub(crate) fn get(obj: &Bound<'_, PyAny>) -> PyResult<Exported> {
        let mut view = Box::new(ffi::Py_buffer::new());
        // SAFETY: `view` is a valid, zeroed Py_buffer for the exporter to fill; on success it
        // holds a reference to `obj` and the export until `PyBuffer_Release` (in `Drop`).
        if unsafe { ffi::PyObject_GetBuffer(obj.as_ptr(), &mut *view, ffi::PyBUF_FULL_RO) } < 0 {
            return Err(PyErr::fetch(obj.py()));
        }
        let exported = Exported(view);
        // SAFETY: a buffer just filled by its exporter.
        if unsafe { ffi::PyBuffer_IsContiguous(&*exported.0, b'C' as std::ffi::c_char) } == 0 {
            return Err(PyBufferError::new_err(
                "isthmus sends C-contiguous buffers only; this one is not (numpy.ascontiguousarray makes one)",
            ));
        }
        Ok(exported)
    }

    /// The length in bytes.
    pub(crate) fn len(&self) -> usize {
        self.as_slice().len()
    }

    /// Where the bytes start (dangling when there are none).
    pub(crate) fn ptr(&self) -> *const u8 {
        self.as_slice().as_ptr()
    }

    pub(crate) fn as_slice(&self) -> &[u8] {
        match usize::try_from(self.0.len) {
            Ok(len) if len > 0 && !self.0.buf.is_null() => {
                // SAFETY: a C-contiguous export: `len` bytes from `buf`, valid while the export
                // is held, which is as long as `self`. A writable exporter (a bytearray, a numpy
                // array) may yet be written by another Python thread while this is read with the
                // GIL released. Rust's model calls that a data race, which no type here can
                // prevent (grpcio's copies race alike): the slice only feeds copies (memcpy) of
                // memory that stays mapped, which then hold torn bytes, and the module's
                // documentation tells callers not to write a buffer while it is sent.
                unsafe { std::slice::from_raw_parts(self.0.buf.cast::<u8>(), len) }
            }
            _ => &[],
        }
    }
}

// SAFETY: the export is only read (through `as_slice`), its memory stays valid until
// `PyBuffer_Release`, and that release takes the GIL on whichever thread drops it.
unsafe impl Send for Exported {}

impl Drop for Exported {
    fn drop(&mut self) {
        // SAFETY: a buffer filled by `PyObject_GetBuffer` and not yet released.
        Python::attach(|_| unsafe { ffi::PyBuffer_Release(&mut *self.0) });
    }
}

/// The bytes of `obj` to send: a [`Block`]'s own, or any C-contiguous buffer's, read in place.
pub(crate) enum Request {
    Block(Outgoing),
    Buffer(Exported),
}

/// The bytes of a request that is not a shared-memory block (which has none to lend: it is
/// sent where it is); empty for one.
impl AsRef<[u8]> for Request {
    fn as_ref(&self) -> &[u8] {
        self.as_slice().unwrap_or_default()
    }
}

impl Request {
    pub(crate) fn from_py(obj: &Bound<'_, PyAny>) -> PyResult<Request> {
        if let Ok(block) = obj.cast::<Block>() {
            let mut block = block.try_borrow_mut().map_err(|_| PyBufferError::new_err("the block is in use"))?;
            return block.take().map(Request::Block);
        }
        Exported::get(obj).map(Request::Buffer)
    }

    /// The bytes, when they are not a shared-memory block.
    pub(crate) fn as_slice(&self) -> Option<&[u8]> {
        match self {
            Request::Block(Outgoing::Shm(_)) => None,
            Request::Block(Outgoing::Heap(bytes)) => Some(bytes.as_ref()),
            Request::Buffer(buffer) => Some(buffer.as_slice()),
        }
    }
}
