//! A service's contract at run time: `.proto` files compiled when a program loads them
//! (protox), and messages converted between protobuf and proto3's JSON mapping
//! (prost-reflect). For languages with no protobuf library of their own at hand: LuaJIT inside
//! nginx turns its tables into JSON, and this turns JSON into the bytes a call sends.

use std::collections::HashMap;
use std::ffi::{c_char, CString};
use std::path::{Path, PathBuf};

use bytes::Bytes;
use isthmus::{Code, Status};
use prost::Message as _;
use prost_reflect::{DescriptorPool, DynamicMessage, MessageDescriptor, ReflectMessage as _, SerializeOptions};

use crate::abi::{c_bytes, c_str, c_strs, entry_out, guard, invalid, isthmus_code_t, isthmus_status_t};
use crate::handle::Registry;
use crate::object::{isthmus_message_t, message_handle};

/// Message types and services loaded from `.proto` files or a descriptor set. Free it with
/// `isthmus_proto_free`.
pub struct isthmus_proto_t {
    pool: DescriptorPool,
    /// Each method's request and response type names, and its `ISTHMUS_PROTO_*_STREAMING`
    /// bits, by path (`/package.Service/Method`).
    methods: HashMap<String, ([CString; 2], i32)>,
}

/// `isthmus_proto_method_type`: the request's type.
pub const ISTHMUS_PROTO_REQUEST: i32 = 0;
/// `isthmus_proto_method_type`: the response's type.
pub const ISTHMUS_PROTO_RESPONSE: i32 = 1;
/// `isthmus_proto_method_streams`: the client sends a stream of requests.
pub const ISTHMUS_PROTO_CLIENT_STREAMING: i32 = 1;
/// `isthmus_proto_method_streams`: the server sends a stream of responses.
pub const ISTHMUS_PROTO_SERVER_STREAMING: i32 = 2;

pub(crate) static PROTOS: Registry<isthmus_proto_t> = Registry::new("proto");

impl isthmus_proto_t {
    fn new(pool: DescriptorPool) -> Result<isthmus_proto_t, Status> {
        let mut methods = HashMap::new();
        for service in pool.services() {
            for method in service.methods() {
                let name =
                    |m: MessageDescriptor| CString::new(m.full_name()).map_err(|_| invalid("a NUL in a type name"));
                let types = [name(method.input())?, name(method.output())?];
                let streams = i32::from(method.is_client_streaming()) * ISTHMUS_PROTO_CLIENT_STREAMING
                    + i32::from(method.is_server_streaming()) * ISTHMUS_PROTO_SERVER_STREAMING;
                methods.insert(format!("/{}/{}", service.full_name(), method.name()), (types, streams));
            }
        }
        Ok(isthmus_proto_t { pool, methods })
    }

    fn message(&self, name: &str) -> Result<MessageDescriptor, Status> {
        self.pool
            .get_message_by_name(name.trim_start_matches('.'))
            .ok_or_else(|| Status::new(Code::NotFound, format!("no message type {name} is loaded")))
    }
}

/// Compiles `.proto` files (with what they import) at run time. Imports are looked up in the
/// `includes` directories, then in the directory of each file neither under nor found in any of
/// them (with no `includes`, each file's own directory). A file that does not parse, one whose
/// braces nest more than 100 deep, or an import not found, fails with
/// `ISTHMUS_INVALID_ARGUMENT` and a message naming the file and line. Free the result with `isthmus_proto_free`.
///
/// Thread-safety: any thread, whatever its stack: a caller's thread with less than 1 MiB of
/// stack left (4 MiB in a debug build) has the parsing done on a thread of the library's own,
/// and so have `isthmus_proto_load_descriptor_set`, `_encode` and `_decode`.
///
/// # Safety
///
/// `files` holds `nfiles` NUL-terminated paths and `includes` `nincludes` (either may be NULL
/// when its count is 0); `out` is writable; `status` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn isthmus_proto_load(
    files: *const *const c_char,
    nfiles: usize,
    includes: *const *const c_char,
    nincludes: usize,
    out: *mut *mut isthmus_proto_t,
    status: *mut *mut isthmus_status_t,
) -> isthmus_code_t {
    // SAFETY: the caller's promises, passed on.
    unsafe {
        entry_out(out, "proto", status, || {
            let files = c_strs(files, nfiles, "a file")?;
            if files.is_empty() {
                return Err(invalid("no .proto file given"));
            }
            let mut dirs: Vec<PathBuf> =
                c_strs(includes, nincludes, "an include directory")?.into_iter().map(PathBuf::from).collect();
            // A file neither under nor found in any of the includes is found in its own
            // directory (protoc would refuse it: "is not in any include path").
            for file in &files {
                let path = Path::new(file);
                if dirs.iter().any(|d| path.starts_with(d) || (path.is_relative() && d.join(path).exists())) {
                    continue;
                }
                let dir = path.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
                if !dirs.iter().any(|d| d == dir) {
                    dirs.push(dir.to_path_buf());
                }
            }
            if let Some(missing) =
                files.iter().find(|f| !Path::new(f).exists() && !dirs.iter().any(|d| d.join(f).exists()))
            {
                return Err(invalid(format!("cannot load {missing}: no such file")));
            }
            let compile = || -> Result<DescriptorPool, protox::Error> {
                let mut compiler = protox::Compiler::with_file_resolver(Shallow::new(&dirs));
                compiler.include_imports(true);
                compiler.open_files(&files)?;
                Ok(compiler.descriptor_pool())
            };
            let pool =
                on_deep_stack(|| compile().map_err(|e| invalid(format!("cannot load {}: {e}", files.join(", ")))))?;
            Ok(Some(PROTOS.add(isthmus_proto_t::new(pool)?)))
        })
    }
}

/// How deep a `.proto` file's braces and angle brackets may nest (messages in messages,
/// option values): protox and its text-format parser take them by recursion, and a file nested
/// a few thousand deep overflowed any stack, a crash where every other bad file is
/// INVALID_ARGUMENT. At this limit the parse fits in [`STACK_NEEDED`] (unoptimised, ~20 KiB a
/// level). Real files nest a handful deep.
const MAX_NESTING: usize = 100;

/// protox's usual resolver (the include directories, then the well-known types) with each file
/// found on disk looked at before it is parsed: one nested deeper than [`MAX_NESTING`] is
/// refused.
struct Shallow {
    dirs: Vec<PathBuf>,
    inner: protox::file::ChainFileResolver,
}

impl Shallow {
    fn new(dirs: &[PathBuf]) -> Shallow {
        let mut inner = protox::file::ChainFileResolver::new();
        for dir in dirs {
            inner.add(protox::file::IncludeFileResolver::new(dir.clone()));
        }
        inner.add(protox::file::GoogleFileResolver::new());
        Shallow { dirs: dirs.to_vec(), inner }
    }
}

impl protox::file::FileResolver for Shallow {
    fn resolve_path(&self, path: &Path) -> Option<String> {
        self.inner.resolve_path(path)
    }

    fn open_file(&self, name: &str) -> Result<protox::file::File, protox::Error> {
        // The file the include resolvers would open: the first directory that has it.
        if let Some(source) = self.dirs.iter().find_map(|dir| std::fs::read_to_string(dir.join(name)).ok()) {
            if let Some(line) = nested_too_deep(&source) {
                return Err(protox::Error::new(format!("{name}:{line}: braces nested more than {MAX_NESTING} deep")));
            }
        }
        self.inner.open_file(name)
    }
}

/// The line where `source`'s braces (and angle brackets) first nest deeper than
/// [`MAX_NESTING`], if they do; those in comments and string literals do not count.
fn nested_too_deep(source: &str) -> Option<usize> {
    let (mut depth, mut line) = (0usize, 1usize);
    let mut chars = source.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '\n' => line += 1,
            // Angle brackets too: `map<K, V>`, and an option's aggregate value, parsed by
            // recursion as well (`{ c < c < ... > > }`).
            '{' | '<' => {
                depth += 1;
                if depth > MAX_NESTING {
                    return Some(line);
                }
            }
            '}' | '>' => depth = depth.saturating_sub(1),
            '/' if chars.peek() == Some(&'/') => {
                for c in chars.by_ref() {
                    if c == '\n' {
                        line += 1;
                        break;
                    }
                }
            }
            '/' if chars.peek() == Some(&'*') => {
                chars.next();
                let mut star = false;
                for c in chars.by_ref() {
                    match c {
                        '/' if star => break,
                        '\n' => line += 1,
                        _ => {}
                    }
                    star = c == '*';
                }
            }
            '"' | '\'' => {
                let mut escaped = false;
                for s in chars.by_ref() {
                    match s {
                        '\n' => {
                            line += 1;
                            break; // a string does not span lines: the parser says what is wrong
                        }
                        _ if escaped => escaped = false,
                        '\\' => escaped = true,
                        _ if s == c => break,
                        _ => {}
                    }
                }
            }
            _ => {}
        }
    }
    None
}

/// Loads a serialized `google.protobuf.FileDescriptorSet` (what `protoc --include_imports
/// --descriptor_set_out` writes, or a server's reflection gives). Free the result with
/// `isthmus_proto_free`. A set that does not decode, or whose files import one another in a
/// cycle or more than 100 deep, fails with `ISTHMUS_INVALID_ARGUMENT`.
///
/// Thread-safety: any thread, whatever its stack (as `isthmus_proto_load`).
///
/// # Safety
///
/// `data` is valid for `len` bytes; `out` is writable; `status` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn isthmus_proto_load_descriptor_set(
    data: *const u8,
    len: usize,
    out: *mut *mut isthmus_proto_t,
    status: *mut *mut isthmus_status_t,
) -> isthmus_code_t {
    // SAFETY: the caller's promises, passed on.
    unsafe {
        entry_out(out, "proto", status, || {
            let data = c_bytes(data, len, "the descriptor set")?;
            imports_are_a_shallow_dag(data)?;
            let pool = on_deep_stack(|| {
                DescriptorPool::decode(data).map_err(|e| invalid(format!("not a usable FileDescriptorSet: {e}")))
            })?;
            Ok(Some(PROTOS.add(isthmus_proto_t::new(pool)?)))
        })
    }
}

/// How deep a descriptor set's files may import one another (a file importing a file importing
/// ...), and how deep `google.protobuf.Any` messages may nest in bytes being decoded: both are
/// taken by recursion (prost-reflect's), neither with a bound of its own.
const MAX_DEPTH: usize = 100;

/// As much of a `google.protobuf.FileDescriptorSet` as the import check reads.
#[derive(Clone, PartialEq, prost::Message)]
struct FileImportsSet {
    #[prost(message, repeated, tag = "1")]
    file: Vec<FileImports>,
}

/// A file's name, what it imports and which of those imports are public
/// (`FileDescriptorProto` fields 1, 3 and 10).
#[derive(Clone, PartialEq, prost::Message)]
struct FileImports {
    #[prost(string, optional, tag = "1")]
    name: Option<String>,
    #[prost(string, repeated, tag = "3")]
    dependency: Vec<String>,
    #[prost(int32, repeated, tag = "10")]
    public_dependency: Vec<i32>,
}

/// How many paths through public imports prost-reflect may walk for a descriptor set: it
/// walks each path from each import of each file, not each file once, so a few layers of files
/// that each publicly import the next layer's two make 2^layers walks.
const MAX_PUBLIC_PATHS: u64 = 100_000;

/// Refuses a descriptor set whose files import one another in a cycle, or in a chain deeper
/// than [`MAX_DEPTH`], or whose public imports make more than [`MAX_PUBLIC_PATHS`] paths:
/// prost-reflect resolves imports by recursion, and two files that publicly import each other
/// recursed until the stack overflowed (a crash of the whole process, from bytes a server's
/// reflection may give), and 120 files in layers that publicly import the next layer's two
/// (a few KB) would have had it walk 2^60 paths. protoc refuses cycles.
fn imports_are_a_shallow_dag(data: &[u8]) -> Result<(), Status> {
    let set = FileImportsSet::decode(data).map_err(|e| invalid(format!("not a usable FileDescriptorSet: {e}")))?;
    let index: HashMap<&str, usize> =
        set.file.iter().enumerate().filter_map(|(i, f)| f.name.as_deref().map(|n| (n, i))).collect();
    let imports: Vec<Vec<usize>> =
        set.file.iter().map(|f| f.dependency.iter().filter_map(|d| index.get(d.as_str()).copied()).collect()).collect();
    let public: Vec<Vec<usize>> = set
        .file
        .iter()
        .map(|f| {
            let named = |&i: &i32| usize::try_from(i).ok().and_then(|i| f.dependency.get(i));
            f.public_dependency.iter().filter_map(named).filter_map(|d| index.get(d.as_str()).copied()).collect()
        })
        .collect();
    // Paths through public imports from each file, itself included (saturating).
    let mut paths = vec![0u64; imports.len()];
    // Depth-first, by hand (a recursion here would have the same problem): `depth[i]` is the
    // longest import chain from file i once it is done; `open` marks the files on the path.
    let (mut depth, mut open) = (vec![None::<usize>; imports.len()], vec![false; imports.len()]);
    for root in 0..imports.len() {
        let mut path = vec![(root, 0usize)];
        while let Some(&mut (file, ref mut next)) = path.last_mut() {
            if depth[file].is_some() {
                path.pop();
                continue;
            }
            open[file] = true;
            if let Some(&import) = imports[file].get(*next) {
                *next += 1;
                if open[import] {
                    let name = |i: usize| set.file[i].name.as_deref().unwrap_or("?");
                    return Err(invalid(format!("{} and {} import each other (a cycle)", name(file), name(import))));
                }
                if depth[import].is_none() {
                    if path.len() > MAX_DEPTH {
                        return Err(invalid(format!("files import one another more than {MAX_DEPTH} deep")));
                    }
                    path.push((import, 0));
                }
                continue;
            }
            let deepest = imports[file].iter().filter_map(|&i| depth[i]).max().map_or(0, |d| d + 1);
            if deepest > MAX_DEPTH {
                return Err(invalid(format!("files import one another more than {MAX_DEPTH} deep")));
            }
            depth[file] = Some(deepest);
            // Every public import is an import, so each is done by now.
            paths[file] = public[file].iter().fold(1u64, |sum, &i| sum.saturating_add(paths[i]));
            open[file] = false;
            path.pop();
        }
    }
    // prost-reflect walks the public paths from every import of every file.
    let walks = imports.iter().flatten().fold(0u64, |sum, &i| sum.saturating_add(paths[i]));
    if walks > MAX_PUBLIC_PATHS {
        return Err(invalid(format!(
            "the files' public imports make {walks} paths to resolve (at most {MAX_PUBLIC_PATHS})"
        )));
    }
    Ok(())
}

/// Refuses bytes whose `google.protobuf.Any` messages nest, with the messages between them,
/// deeper than [`MAX_DEPTH`], or hold more than [`ANY_HELD`] times the message's `len` bytes
/// (and a MiB) along one line of `Any`s. prost bounds the nesting of one message's bytes, but
/// writing an `Any` as JSON decodes its payload afresh, with a fresh bound, and serde_json's
/// writer has none: an `Any` in an `Any` 100,000 deep (5 MB from a peer) ran a process out of
/// memory, and deep enough overflows any stack. And each level holds copies of its payload
/// while the levels inside it are written: 100 levels around 40 MB held some 8 GB. Its caller
/// walks only the messages of a pool that declares `Any`.
fn any_nesting_is_shallow(message: &DynamicMessage, len: usize) -> Result<(), Status> {
    /// `held`: the payload bytes of the `Any`s around `message`.
    fn walk(message: &DynamicMessage, depth: usize, held: usize, budget: usize) -> Result<(), Status> {
        if depth > MAX_DEPTH {
            return Err(invalid(format!("messages in google.protobuf.Any nest more than {MAX_DEPTH} deep")));
        }
        let desc = message.descriptor();
        if desc.full_name() == "google.protobuf.Any" {
            let url = message.get_field_by_number(1);
            let bytes = message.get_field_by_number(2);
            let (Some(url), Some(bytes)) =
                (url.as_deref().and_then(|v| v.as_str()), bytes.as_deref().and_then(|v| v.as_bytes()))
            else {
                return Ok(());
            };
            let name = url.rsplit('/').next().unwrap_or(url);
            // A type no loaded file declares, or bytes that are not one: the JSON writer says so.
            if let Some(inner) = desc.parent_pool().get_message_by_name(name) {
                let held = held.saturating_add(bytes.len());
                if held > budget {
                    return Err(invalid(format!(
                        "messages in google.protobuf.Any nest {held} bytes deep, past {ANY_HELD} times the message's"
                    )));
                }
                if let Ok(payload) = DynamicMessage::decode(inner, bytes.clone()) {
                    walk(&payload, depth + 1, held, budget)?;
                }
            }
            return Ok(());
        }
        let values = message.fields().map(|(_, v)| v).chain(message.extensions().map(|(_, v)| v));
        for value in values {
            match value {
                prost_reflect::Value::Message(m) => walk(m, depth + 1, held, budget)?,
                prost_reflect::Value::List(items) => {
                    for item in items {
                        if let prost_reflect::Value::Message(m) = item {
                            walk(m, depth + 1, held, budget)?;
                        }
                    }
                }
                prost_reflect::Value::Map(entries) => {
                    for item in entries.values() {
                        if let prost_reflect::Value::Message(m) = item {
                            walk(m, depth + 1, held, budget)?;
                        }
                    }
                }
                _ => {}
            }
        }
        Ok(())
    }
    walk(message, 0, 0, len.saturating_mul(ANY_HELD).saturating_add(1 << 20))
}

/// How many times a message's size its nested `Any`s may hold, along one line of them, before
/// it is refused ([`any_nesting_is_shallow`]): real messages nest one or two deep.
const ANY_HELD: usize = 4;

/// The full name of the request (`which` = `ISTHMUS_PROTO_REQUEST`) or response
/// (`ISTHMUS_PROTO_RESPONSE`) type of the method at `path` (`/package.Service/Method`),
/// NUL-terminated and valid until the proto is freed; NULL if no loaded service has that method
/// (or for an invalid handle).
///
/// Thread-safety: any thread; the string goes with `isthmus_proto_free`, so do not free the proto
/// on another thread while it is in use.
///
/// # Safety
///
/// `path` is a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn isthmus_proto_method_type(
    proto: *const isthmus_proto_t,
    path: *const c_char,
    which: i32,
) -> *const c_char {
    guard(std::ptr::null(), || {
        let Ok(proto) = PROTOS.get(proto) else { return std::ptr::null() };
        // SAFETY: the caller promises a NUL-terminated string.
        let Ok(path) = (unsafe { c_str(path, "the path") }) else { return std::ptr::null() };
        let index = match which {
            ISTHMUS_PROTO_REQUEST => 0,
            ISTHMUS_PROTO_RESPONSE => 1,
            _ => return std::ptr::null(),
        };
        // The names live as long as the proto's handle; the registry's Arc outlives this guard.
        proto.methods.get(path).map_or(std::ptr::null(), |(types, _)| types[index].as_ptr())
    })
}

/// Which sides of the method at `path` (`/package.Service/Method`) stream: its
/// `ISTHMUS_PROTO_CLIENT_STREAMING` and `ISTHMUS_PROTO_SERVER_STREAMING` bits (0 for a unary
/// method); -1 if no loaded service has that method (or for an invalid handle or path). A
/// binding that starts a call through a general stream half-closes it after the one request
/// of a method whose client does not stream, as generated clients do: a server may wait for
/// that half-close before it answers (tonic's does).
///
/// Thread-safety: any thread.
///
/// # Safety
///
/// `path` is a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn isthmus_proto_method_streams(proto: *const isthmus_proto_t, path: *const c_char) -> i32 {
    guard(-1, || {
        let Ok(proto) = PROTOS.get(proto) else { return -1 };
        // SAFETY: the caller promises a NUL-terminated string.
        let Ok(path) = (unsafe { c_str(path, "the path") }) else { return -1 };
        proto.methods.get(path).map_or(-1, |(_, streams)| *streams)
    })
}

/// Encodes a message of type `type_name` (`package.Message`) from its proto3 JSON form: `*out`
/// holds the protobuf bytes. JSON that does not fit the type fails with
/// `ISTHMUS_INVALID_ARGUMENT` and a message naming the field. What a JSON encoder of Lua
/// tables cannot tell apart is taken as the type declares it: an empty object (`{}`) for an
/// empty repeated field, and an array for a map field as keys 1..n (a Lua table with keys
/// 1..n is an array to any encoder).
///
/// Thread-safety: any thread, whatever its stack (as `isthmus_proto_load`); several may use one
/// proto at once.
///
/// # Safety
///
/// `type_name` is NUL-terminated; `json` is valid for `json_len` bytes; `out` is writable;
/// `status` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn isthmus_proto_encode(
    proto: *const isthmus_proto_t,
    type_name: *const c_char,
    json: *const u8,
    json_len: usize,
    out: *mut *mut isthmus_message_t,
    status: *mut *mut isthmus_status_t,
) -> isthmus_code_t {
    // SAFETY: the caller's promises, passed on.
    unsafe {
        convert(proto, type_name, (json, json_len, "the JSON"), out, status, |desc, json| {
            let not_a = |e: serde_json::Error| invalid(format!("JSON is not a {}: {e}", desc.full_name()));
            let mut de = serde_json::Deserializer::from_slice(json);
            let strict = DynamicMessage::deserialize(desc.clone(), &mut de).and_then(|m| de.end().map(|()| m));
            // JSON that fits as it is is read as it is; only what does not may be a shape a
            // Lua encoder could not tell apart. The error is the first reading's (with its
            // position), unless reshaping changed something: then the second's, since the
            // first may name an empty table that was fine (`{"labels": {}, "seq": "x"}`).
            let message = match strict {
                Ok(m) => m,
                Err(e) => {
                    let Ok(mut value) = serde_json::from_slice::<serde_json::Value>(json) else {
                        return Err(not_a(e));
                    };
                    if !as_declared(&desc, &mut value) {
                        return Err(not_a(e));
                    }
                    DynamicMessage::deserialize(desc.clone(), value).map_err(not_a)?
                }
            };
            Ok(message.encode_to_vec())
        })
    }
}

/// Decodes protobuf bytes of type `type_name` into its proto3 JSON form, with the field names
/// the `.proto` file gives (`time_left_ms`, not `timeLeftMs`; encoding takes either): fields at
/// their default value left out, 64-bit integers as strings, `bytes` in base64. `*out` holds
/// the JSON text. Bytes that are not such a message, or whose `google.protobuf.Any` values nest
/// more than 100 deep, fail with `ISTHMUS_INVALID_ARGUMENT`.
///
/// Thread-safety: any thread, whatever its stack (as `isthmus_proto_load`); several may use one
/// proto at once.
///
/// # Safety
///
/// `type_name` is NUL-terminated; `data` is valid for `len` bytes; `out` is writable; `status`
/// is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn isthmus_proto_decode(
    proto: *const isthmus_proto_t,
    type_name: *const c_char,
    data: *const u8,
    len: usize,
    out: *mut *mut isthmus_message_t,
    status: *mut *mut isthmus_status_t,
) -> isthmus_code_t {
    // SAFETY: the caller's promises, passed on.
    unsafe {
        convert(proto, type_name, (data, len, "the message"), out, status, |desc, bytes| {
            let bytes_len = bytes.len();
            let message = DynamicMessage::decode(desc.clone(), bytes)
                .map_err(|e| invalid(format!("the bytes are not a {}: {e}", desc.full_name())))?;
            if message.descriptor().parent_pool().get_message_by_name("google.protobuf.Any").is_some() {
                any_nesting_is_shallow(&message, bytes_len)?;
            }
            let options = SerializeOptions::new().use_proto_field_name(true);
            let mut json = Vec::new();
            message
                .serialize_with_options(&mut serde_json::Serializer::new(&mut json), &options)
                // What the bytes hold, not the library, is why (an `Any` of a type no loaded
                // `.proto` declares).
                .map_err(|e| invalid(format!("the {} cannot be written as proto3 JSON: {e}", desc.full_name())))?;
            Ok(json)
        })
    }
}

/// Reshapes what a JSON encoder of Lua tables cannot tell apart into what `desc` declares, in
/// `value` and the messages inside it: an empty object given for a repeated field (or a
/// `google.protobuf.ListValue`) becomes an empty array, and an array given for a map field an
/// object keyed `"1"`..`"n"` (a Lua table with keys 1..n is an array to any encoder; its null
/// entries, holes, are left out). The other well-known types (`google.protobuf.*`), whose JSON
/// forms are their own, are left as they are. Whether it changed anything.
fn as_declared(desc: &MessageDescriptor, value: &mut serde_json::Value) -> bool {
    use serde_json::Value;
    let empty_object = |v: &Value| matches!(v, Value::Object(o) if o.is_empty());
    if desc.full_name() == "google.protobuf.ListValue" {
        if empty_object(value) {
            *value = Value::Array(Vec::new());
            return true;
        }
        return false;
    }
    if desc.full_name().starts_with("google.protobuf.") {
        return false;
    }
    let Value::Object(fields) = value else { return false };
    let mut changed = false;
    for (name, v) in fields.iter_mut() {
        let Some(field) = desc.get_field_by_name(name).or_else(|| desc.get_field_by_json_name(name)) else {
            continue; // deserializing names it
        };
        let kind = field.kind();
        let inner = kind.as_message();
        if field.is_map() {
            if let Value::Array(items) = v {
                let entries = std::mem::take(items).into_iter().enumerate().filter(|(_, item)| !item.is_null());
                *v = Value::Object(entries.map(|(i, item)| ((i + 1).to_string(), item)).collect());
                changed = true;
            }
            let values = inner.map(|entry| entry.map_entry_value_field().kind());
            if let (Some(prost_reflect::Kind::Message(m)), Value::Object(entries)) = (values, v) {
                changed = entries.values_mut().fold(changed, |c, e| as_declared(&m, e) | c);
            }
        } else if field.is_list() {
            if empty_object(v) {
                *v = Value::Array(Vec::new());
                changed = true;
            }
            if let (Some(m), Value::Array(items)) = (inner, v) {
                changed = items.iter_mut().fold(changed, |c, item| as_declared(m, item) | c);
            }
        } else if let Some(m) = inner {
            changed |= as_declared(m, v);
        }
    }
    changed
}

/// The shape of `_encode` and `_decode`: the type `type_name` looked up in `proto`, and the
/// caller's bytes (`input`: pointer, length, and what they are, for errors) turned by `f` into
/// the bytes of a new message handle in `*out`.
///
/// # Safety
///
/// As the two entry points: `type_name` NUL-terminated, the input valid for its length, `out`
/// writable, `status` NULL or writable.
unsafe fn convert(
    proto: *const isthmus_proto_t,
    type_name: *const c_char,
    input: (*const u8, usize, &str),
    out: *mut *mut isthmus_message_t,
    status: *mut *mut isthmus_status_t,
    f: impl FnOnce(MessageDescriptor, &[u8]) -> Result<Vec<u8>, Status> + Send,
) -> isthmus_code_t {
    // SAFETY: the caller's promises, passed on.
    unsafe {
        entry_out(out, "message", status, || {
            let proto = PROTOS.get(proto)?;
            let desc = proto.message(c_str(type_name, "the type name")?)?;
            let input = c_bytes(input.0, input.1, input.2)?;
            let bytes = on_deep_stack(|| f(desc, input))?;
            Ok(Some(message_handle(Bytes::from(bytes))))
        })
    }
}

/// The stack a conversion or a load may use: JSON, protobuf and `.proto` files are taken by
/// recursion, up to serde_json's 128 levels, prost's 100 and [`MAX_NESTING`], a few KiB a level
/// optimised and ten times that not (a C library built in a debug profile).
const STACK_NEEDED: usize = if cfg!(debug_assertions) { 4 << 20 } else { 1 << 20 };

/// The stack of the thread [`on_deep_stack`] starts: only what it touches is committed.
const STACK_OWN: usize = 16 << 20;

/// Runs `f` where at least [`STACK_NEEDED`] of stack is free: on the caller's thread when it
/// has that much left (an nginx worker's or a Go thread's 8 MiB), else on a thread of its own.
/// A C caller's thread may have a small stack (a few hundred KiB: musl's default, a pool's
/// setting), and input nested as deep as the parsers allow overflowed one, a crash of the
/// whole process where every other bad input is INVALID_ARGUMENT.
fn on_deep_stack<T: Send>(f: impl FnOnce() -> Result<T, Status> + Send) -> Result<T, Status> {
    if stack_left().is_some_and(|left| left >= STACK_NEEDED) {
        return f();
    }
    std::thread::scope(|scope| {
        let thread = std::thread::Builder::new().name("isthmus-proto".into()).stack_size(STACK_OWN);
        let running = thread.spawn_scoped(scope, f).map_err(|e| {
            Status::new(Code::ResourceExhausted, format!("cannot start a thread for the conversion: {e}"))
        })?;
        // A panic goes on to the entry point's guard, as it would have on this thread.
        running.join().unwrap_or_else(|panic| std::panic::resume_unwind(panic))
    })
}

/// The stack left below this frame on the calling thread, if the thread says where its stack
/// is (found once per thread) and this frame is on it: a fiber's or `makecontext`'s stack,
/// which the thread does not know of, is taken as unknown (too small).
fn stack_left() -> Option<usize> {
    thread_local! {
        static BOUNDS: std::cell::Cell<Option<(usize, usize)>> = const { std::cell::Cell::new(None) };
    }
    let (lowest, highest) = BOUNDS.with(|bounds| {
        if bounds.get().is_none() {
            bounds.set(stack_bounds());
        }
        bounds.get()
    })?;
    let here = 0u8;
    let here = std::ptr::addr_of!(here) as usize;
    (lowest..highest).contains(&here).then(|| here - lowest)
}

/// The calling thread's stack: its lowest usable address (above the guard) and its top.
fn stack_bounds() -> Option<(usize, usize)> {
    // SAFETY: `attr` is initialised by `pthread_getattr_np` for the calling thread before it is
    // read, and destroyed once; the out-pointers are locals.
    unsafe {
        let mut attr: libc::pthread_attr_t = std::mem::zeroed();
        if libc::pthread_getattr_np(libc::pthread_self(), &mut attr) != 0 {
            return None;
        }
        let (mut addr, mut size, mut guard) = (std::ptr::null_mut(), 0usize, 0usize);
        let found = libc::pthread_attr_getstack(&attr, &mut addr, &mut size) == 0
            && libc::pthread_attr_getguardsize(&attr, &mut guard) == 0;
        libc::pthread_attr_destroy(&mut attr);
        found.then(|| (addr as usize + guard, addr as usize + size))
    }
}

/// Frees a proto.
///
/// Thread-safety: any thread, once; not while another thread still uses it or a string from
/// `isthmus_proto_method_type`.
#[no_mangle]
pub extern "C" fn isthmus_proto_free(proto: *mut isthmus_proto_t) -> isthmus_code_t {
    crate::abi::entry(std::ptr::null_mut(), || PROTOS.remove(proto).map(drop))
}

#[cfg(test)]
mod tests {
    use std::ffi::{CStr, CString};

    use super::*;
    use crate::abi::{
        isthmus_status_free, isthmus_status_message, ISTHMUS_INVALID_ARGUMENT, ISTHMUS_NOT_FOUND, ISTHMUS_OK,
    };
    use crate::object::{isthmus_message_data, isthmus_message_free};

    const PROTO: &str = r#"syntax = "proto3";
package demo;
import "google/protobuf/any.proto";
message Boxed { google.protobuf.Any held = 1; }
message Ping { bytes payload = 1; uint64 seq = 2; string note_text = 3; repeated string labels = 4; map<string, string> attrs = 5; }
message Pong { repeated Ping pings = 1; map<string, Ping> by_name = 2; Ping first = 3; }
service Echo { rpc Call(Ping) returns (Pong); rpc Watch(Ping) returns (stream Pong); rpc Chat(stream Ping) returns (stream Pong); }
"#;

    fn load() -> (*mut isthmus_proto_t, tempdir::Dir) {
        load_text(PROTO)
    }

    /// `source` written to a file and loaded.
    fn load_text(source: &str) -> (*mut isthmus_proto_t, tempdir::Dir) {
        let dir = tempdir::Dir::new();
        let file = dir.0.join("demo.proto");
        std::fs::write(&file, source).expect("write");
        let path = CString::new(file.to_str().expect("utf8")).expect("cstr");
        let files = [path.as_ptr()];
        let mut proto = std::ptr::null_mut();
        // SAFETY: one valid path; valid out-pointer.
        let rc =
            unsafe { isthmus_proto_load(files.as_ptr(), 1, std::ptr::null(), 0, &mut proto, std::ptr::null_mut()) };
        assert_eq!(rc, ISTHMUS_OK);
        (proto, dir)
    }

    /// `source` written to a file and loaded: the code, and the failure's message.
    fn load_source(source: &str) -> (isthmus_code_t, String) {
        let dir = tempdir::Dir::new();
        let file = dir.0.join("deep.proto");
        std::fs::write(&file, source).expect("write");
        let path = CString::new(file.to_str().expect("utf8")).expect("cstr");
        let files = [path.as_ptr()];
        let (mut proto, mut status) = (std::ptr::null_mut(), std::ptr::null_mut());
        // SAFETY: one valid path; valid out-pointers.
        let rc = unsafe { isthmus_proto_load(files.as_ptr(), 1, std::ptr::null(), 0, &mut proto, &mut status) };
        loaded(rc, proto, status)
    }

    /// Messages nested `depth` deep, with braces in a comment and a string that do not count.
    fn nested(depth: usize) -> String {
        let mut s = String::from("syntax = \"proto3\";\n// {{{{ not a brace\n/* {{{{ */\n");
        for i in 0..depth {
            s.push_str(&format!("message M{i} {{ string s{i} = 1 [json_name = \"x{{\"];\n"));
        }
        s.push_str(&"}\n".repeat(depth));
        s.push_str("message Maps { map<string, string> m = 1; }\n");
        s
    }

    /// A message option's aggregate value nested `depth` deep in angle brackets, on one line.
    fn nested_option(depth: usize) -> String {
        let mut s = String::from(
            "syntax = \"proto2\";\nimport \"google/protobuf/descriptor.proto\";\n\
             message N { optional N c = 1; }\n\
             extend google.protobuf.MessageOptions { optional N o = 50000; }\n\
             message X { option (o) = { ",
        );
        s.push_str(&"c < ".repeat(depth));
        s.push_str(&"> ".repeat(depth));
        s.push_str("}; }\n");
        s
    }

    /// A file nested a few thousand deep is INVALID_ARGUMENT, naming the line: protox's parser
    /// recursed into it and overflowed the caller's stack (a crash of the whole process). One
    /// nested as deep as the limit loads, braces in comments and strings not counted.
    #[test]
    fn a_proto_nested_too_deep_is_refused_not_a_crash() {
        // A small stack, as a C caller's thread may have: 1,000 levels overflowed 256 KiB, and
        // the limit's 100 overflowed 64 KiB before the parser ran on a stack of its own.
        let loads = std::thread::Builder::new().stack_size(64 << 10);
        let loaded = loads.spawn(|| {
            // The option's value sits inside two braces of its own (`message X {`, `= {`).
            [nested(3000), nested(MAX_NESTING), nested_option(3000), nested_option(MAX_NESTING - 2)]
                .map(|source| load_source(&source))
        });
        let [deep, shallow, deep_option, shallow_option] = loaded.expect("thread").join().expect("no crash");
        assert_eq!(deep.0, ISTHMUS_INVALID_ARGUMENT, "{}", deep.1);
        assert!(deep.1.contains("deep.proto:104: braces nested more than 100 deep"), "{}", deep.1);
        assert_eq!(shallow, (ISTHMUS_OK, String::new()));
        assert_eq!(deep_option.0, ISTHMUS_INVALID_ARGUMENT, "{}", deep_option.1);
        assert!(deep_option.1.contains("deep.proto:5: braces nested more than 100 deep"), "{}", deep_option.1);
        assert_eq!(shallow_option, (ISTHMUS_OK, String::new()));
    }

    /// Messages nested as deep as prost and serde_json take convert on a caller's thread with a
    /// small stack (64 KiB, as a C pool's thread may have), and deeper ones fail
    /// INVALID_ARGUMENT: a recursive message 100 deep overflowed such a thread, a crash of the
    /// whole process on bytes a peer sent or a table a Lua caller built.
    #[test]
    fn deep_messages_convert_on_a_small_stack() {
        let (proto, _dir) = load_text("syntax = \"proto3\";\nmessage R { R r = 1; string s = 2; }\n");
        // `R` nested `depth` deep, as protobuf bytes and as JSON.
        let bytes = |depth: usize| {
            let mut b = vec![0x12, 1, b'x'];
            for _ in 0..depth {
                let mut outer = vec![0x0a];
                prost::encoding::encode_varint(b.len() as u64, &mut outer);
                outer.extend(b);
                b = outer;
            }
            b
        };
        let json = |depth: usize| format!("{}{{\"s\": \"x\"}}{}", "{\"r\": ".repeat(depth), "}".repeat(depth));
        let p = proto as usize;
        let small = std::thread::Builder::new().stack_size(64 << 10);
        let converted = small.spawn(move || {
            let proto = p as *mut isthmus_proto_t;
            let ty = c"R";
            let decoded = [98, 500].map(|depth| try_decode(proto, ty, &bytes(depth)).map(|j| j.len()));
            let encoded = [98, 126, 500].map(|depth| encode(proto, ty, &json(depth)).map(|b| b.len()));
            (decoded, encoded)
        });
        let (decoded, encoded) = converted.expect("thread").join().expect("no crash");
        assert!(decoded[0].is_ok(), "{decoded:?}");
        assert_eq!(encoded[0].as_ref().ok(), Some(&bytes(98).len()), "{encoded:?}");
        assert!(encoded[1].is_ok(), "{encoded:?}");
        for failed in [&decoded[1], &encoded[2]] {
            let (code, message) = failed.as_ref().expect_err("too deep");
            assert_eq!(*code, ISTHMUS_INVALID_ARGUMENT, "{message}");
        }
        assert_eq!(isthmus_proto_free(proto), ISTHMUS_OK);
    }

    /// A descriptor set as a server's reflection might give one: files by name, what each
    /// imports, and which of those imports are public (the import check's own fields).
    fn descriptor_set(files: &[(&str, &[&str], &[i32])]) -> Vec<u8> {
        let file = files
            .iter()
            .map(|(name, imports, public)| FileImports {
                name: Some((*name).to_owned()),
                dependency: imports.iter().map(|i| (*i).to_owned()).collect(),
                public_dependency: public.to_vec(),
            })
            .collect();
        FileImportsSet { file }.encode_to_vec()
    }

    /// A load's code and the failure's message (empty on success); frees what it made.
    fn loaded(
        rc: isthmus_code_t,
        proto: *mut isthmus_proto_t,
        status: *mut isthmus_status_t,
    ) -> (isthmus_code_t, String) {
        if rc == ISTHMUS_OK {
            assert_eq!(isthmus_proto_free(proto), ISTHMUS_OK);
            return (rc, String::new());
        }
        // SAFETY: a status was stored on failure.
        let message = unsafe { CStr::from_ptr(isthmus_status_message(status)) }.to_string_lossy().into_owned();
        isthmus_status_free(status);
        (rc, message)
    }

    /// `isthmus_proto_load_descriptor_set` of `set`: the code, and the failure's message.
    fn load_set(set: &[u8]) -> (isthmus_code_t, String) {
        let (mut proto, mut status) = (std::ptr::null_mut(), std::ptr::null_mut());
        // SAFETY: valid bytes and out-pointers.
        let rc = unsafe { isthmus_proto_load_descriptor_set(set.as_ptr(), set.len(), &mut proto, &mut status) };
        loaded(rc, proto, status)
    }

    /// Files that import one another in a cycle, in a chain deeper than the limit, or through
    /// more public paths than the limit are INVALID_ARGUMENT: two that publicly imported each
    /// other recursed in prost-reflect until the stack overflowed, a crash of the process on
    /// 44 bytes a server's reflection could send. A chain or layers within the limits load.
    #[test]
    fn a_descriptor_set_whose_imports_cycle_is_refused_not_a_crash() {
        let cycle = descriptor_set(&[("a.proto", &["b.proto"], &[0]), ("b.proto", &["a.proto"], &[0])]);
        let (code, message) = load_set(&cycle);
        assert_eq!(code, ISTHMUS_INVALID_ARGUMENT, "{message}");
        assert!(message.contains("import each other (a cycle)"), "{message}");
        let itself = descriptor_set(&[("a.proto", &["a.proto"], &[0])]);
        assert_eq!(load_set(&itself).0, ISTHMUS_INVALID_ARGUMENT);

        let chain = |n: usize| {
            let names: Vec<String> = (0..=n).map(|i| format!("f{i}.proto")).collect();
            let imports: Vec<[&str; 1]> = (0..n).map(|i| [names[i + 1].as_str()]).collect();
            let mut files: Vec<(&str, &[&str], &[i32])> =
                (0..n).map(|i| (names[i].as_str(), &imports[i][..], &[0][..])).collect();
            files.push((names[n].as_str(), &[], &[]));
            files.reverse(); // each file after what it imports, as protoc writes them
            descriptor_set(&files)
        };
        assert_eq!(load_set(&chain(MAX_DEPTH - 1)), (ISTHMUS_OK, String::new()));
        let (code, message) = load_set(&chain(5000));
        assert_eq!(code, ISTHMUS_INVALID_ARGUMENT, "{message}");
        assert!(message.contains("more than 100 deep"), "{message}");

        // Layers of two files, each publicly importing both of the next layer's, a file that
        // publicly imports the first layer's first, and one importing all three: no cycle, 62
        // deep, and about 2^60 public paths to walk, which held the caller for good (a test
        // without the check ran until its 60 s timeout).
        let layers = |n: usize| {
            let name = |layer: usize, side: usize| format!("l{layer}{}.proto", ["a", "b"][side]);
            let names: Vec<[String; 2]> = (0..=n).map(|l| [name(l, 0), name(l, 1)]).collect();
            let mut files: Vec<(&str, Vec<&str>, &[i32])> = vec![];
            for last in &names[n] {
                files.push((last.as_str(), vec![], &[]));
            }
            for l in (0..n).rev() {
                for file in &names[l] {
                    files.push((file.as_str(), vec![names[l + 1][0].as_str(), names[l + 1][1].as_str()], &[0, 1]));
                }
            }
            files.push(("c.proto", vec![names[0][0].as_str()], &[0]));
            files.push(("top.proto", vec![names[0][0].as_str(), names[0][1].as_str(), "c.proto"], &[]));
            let files: Vec<(&str, &[&str], &[i32])> = files.iter().map(|(n, i, p)| (*n, &i[..], *p)).collect();
            descriptor_set(&files)
        };
        assert_eq!(load_set(&layers(5)), (ISTHMUS_OK, String::new()));
        let (code, message) = load_set(&layers(60));
        assert_eq!(code, ISTHMUS_INVALID_ARGUMENT, "{message}");
        assert!(message.contains("public imports make"), "{message}");
    }

    /// Bytes with `google.protobuf.Any` nested in `Any` deeper than the limit are
    /// INVALID_ARGUMENT; writing them as JSON decoded each payload afresh, with no bound: 100,000
    /// levels (5 MB from a peer) got the test process killed here (its memory ran out while the
    /// writer recursed, each level holding its payload; deep enough, the stack overflows). Ten
    /// levels convert.
    #[test]
    fn anys_nested_too_deep_are_refused_not_a_crash() {
        let (proto, _dir) = load_text(
            "syntax = \"proto3\";\nimport \"google/protobuf/any.proto\";\nmessage W { google.protobuf.Any a = 1; }\n",
        );
        // W { a: Any { Any { ... Any { W {} } } } }, `depth` Anys deep: each Any's value is its
        // last field, so the bytes are the prefixes, outermost first, then the innermost Any.
        let nested = |depth: usize| {
            let any_prefix = |url: &str, value_len: usize| {
                let mut out = vec![0x0a];
                prost::encoding::encode_varint(url.len() as u64, &mut out);
                out.extend_from_slice(url.as_bytes());
                out.push(0x12);
                prost::encoding::encode_varint(value_len as u64, &mut out);
                out
            };
            let innermost = any_prefix("type.googleapis.com/W", 0);
            let mut prefixes = Vec::new();
            let mut len = innermost.len();
            for _ in 1..depth {
                let prefix = any_prefix("type.googleapis.com/google.protobuf.Any", len);
                len += prefix.len();
                prefixes.push(prefix);
            }
            let mut out = vec![0x0a];
            prost::encoding::encode_varint(len as u64, &mut out);
            out.extend(prefixes.into_iter().rev().flatten());
            out.extend(innermost);
            out
        };
        let shallow = try_decode(proto, c"W", &nested(10)).map(|json| String::from_utf8(json).expect("utf8"));
        assert!(shallow.as_deref().is_ok_and(|j| j.matches("@type").count() == 10), "{shallow:?}");
        let (code, message) = try_decode(proto, c"W", &nested(100_000)).expect_err("too deep");
        assert_eq!(code, ISTHMUS_INVALID_ARGUMENT, "{message}");
        // (What it holds is past the bound before its depth is.)
        assert!(message.contains("messages in google.protobuf.Any nest"), "{message}");
        let (code, message) = try_decode(proto, c"W", &nested(102)).expect_err("too deep");
        assert_eq!(code, ISTHMUS_INVALID_ARGUMENT, "{message}");
        assert!(message.contains("nest more than 100 deep"), "{message}");
        assert_eq!(isthmus_proto_free(proto), ISTHMUS_OK);
    }

    /// `Any`s around a large payload are refused past a few levels: each level held copies of
    /// the payload while the ones inside it were written (100 around 40 MB held some 8 GB).
    /// Three levels around 1 MiB convert.
    #[test]
    fn anys_around_a_large_payload_are_refused_past_a_few_levels() {
        let (proto, _dir) = load_text(
            "syntax = \"proto3\";\nimport \"google/protobuf/any.proto\";\n\
             import \"google/protobuf/wrappers.proto\";\n\
             message W { google.protobuf.Any a = 1; google.protobuf.BytesValue b = 2; }\n",
        );
        let field = |tag: u8, body: &[u8]| {
            let mut out = vec![tag];
            prost::encoding::encode_varint(body.len() as u64, &mut out);
            out.extend_from_slice(body);
            out
        };
        let any = |url: &str, value: &[u8]| [field(0x0a, url.as_bytes()), field(0x12, value)].concat();
        // W { a: Any(Any(... Any(BytesValue { value: payload }))) }, `depth` Anys deep.
        let nested = |depth: usize, payload: usize| {
            let mut inner = any("type.googleapis.com/google.protobuf.BytesValue", &field(0x0a, &vec![7u8; payload]));
            for _ in 1..depth {
                inner = any("type.googleapis.com/google.protobuf.Any", &inner);
            }
            field(0x0a, &inner)
        };
        let shallow = try_decode(proto, c"W", &nested(3, 1 << 20));
        assert!(shallow.is_ok(), "{:?}", shallow.map(|j| j.len()));
        let (code, message) = try_decode(proto, c"W", &nested(20, 1 << 20)).expect_err("too much held");
        assert_eq!(code, ISTHMUS_INVALID_ARGUMENT, "{message}");
        assert!(message.contains("times the message's"), "{message}");
        assert_eq!(isthmus_proto_free(proto), ISTHMUS_OK);
    }

    /// The bytes of a message handle, freeing it.
    fn take(msg: *mut isthmus_message_t) -> Vec<u8> {
        let mut len = 0;
        // SAFETY: a live handle; `len` is writable.
        let data = unsafe { isthmus_message_data(msg, &mut len) };
        // SAFETY: the handle's bytes are valid until it is freed, below (NULL: empty).
        let out = if data.is_null() { Vec::new() } else { unsafe { std::slice::from_raw_parts(data, len) }.to_vec() };
        assert_eq!(isthmus_message_free(msg), ISTHMUS_OK);
        out
    }

    fn encode(proto: *mut isthmus_proto_t, ty: &CStr, json: &str) -> Result<Vec<u8>, (isthmus_code_t, String)> {
        let (mut out, mut status) = (std::ptr::null_mut(), std::ptr::null_mut());
        // SAFETY: valid strings, bytes and out-pointers.
        let rc = unsafe { isthmus_proto_encode(proto, ty.as_ptr(), json.as_ptr(), json.len(), &mut out, &mut status) };
        match rc {
            ISTHMUS_OK => Ok(take(out)),
            _ => {
                // SAFETY: a status was stored on failure.
                let message = unsafe { CStr::from_ptr(isthmus_status_message(status)) }.to_string_lossy().into_owned();
                isthmus_status_free(status);
                Err((rc, message))
            }
        }
    }

    /// Bytes of type `ty` as their JSON value.
    fn decode(proto: *mut isthmus_proto_t, ty: &CStr, bytes: &[u8]) -> serde_json::Value {
        serde_json::from_slice(&try_decode(proto, ty, bytes).expect("decode")).expect("json")
    }

    /// Bytes of type `ty` as JSON text, or the failure's code and message.
    fn try_decode(proto: *mut isthmus_proto_t, ty: &CStr, bytes: &[u8]) -> Result<Vec<u8>, (isthmus_code_t, String)> {
        let (mut out, mut status) = (std::ptr::null_mut(), std::ptr::null_mut());
        // SAFETY: valid arguments.
        let rc =
            unsafe { isthmus_proto_decode(proto, ty.as_ptr(), bytes.as_ptr(), bytes.len(), &mut out, &mut status) };
        if rc == ISTHMUS_OK {
            return Ok(take(out));
        }
        assert!(out.is_null());
        // SAFETY: a status was stored on failure.
        let message = unsafe { CStr::from_ptr(isthmus_status_message(status)) }.to_string_lossy().into_owned();
        isthmus_status_free(status);
        Err((rc, message))
    }

    /// An `Any` holding a type no loaded `.proto` declares has no proto3 JSON form, either way
    /// (as in protobuf's own JSON libraries). Decoding such bytes, which a peer sends, failed
    /// INTERNAL, as if the library were at fault; both ways are INVALID_ARGUMENT, naming it.
    #[test]
    fn an_any_of_a_type_not_loaded_is_invalid_both_ways() {
        let (proto, _dir) = load();
        let known = r#"{"held":{"@type":"type.googleapis.com/demo.Ping","seq":"7"}}"#;
        let bytes = encode(proto, c"demo.Boxed", known).expect("an Any of a loaded type");
        assert_eq!(
            decode(proto, c"demo.Boxed", &bytes),
            serde_json::from_str::<serde_json::Value>(known).expect("json")
        );

        let unknown = r#"{"held":{"@type":"type.googleapis.com/demo.Elsewhere","x":1}}"#;
        let (code, message) = encode(proto, c"demo.Boxed", unknown).expect_err("an Any of a type not loaded");
        assert_eq!(code, ISTHMUS_INVALID_ARGUMENT);
        assert!(message.contains("demo.Elsewhere"), "{message}");

        // Boxed { held: Any { type_url: ".../demo.Elsewhere", value: 08 01 } }, as a peer sends it.
        let url = b"type.googleapis.com/demo.Elsewhere";
        let mut any = vec![0x0a, url.len() as u8];
        any.extend_from_slice(url);
        any.extend_from_slice(&[0x12, 0x02, 0x08, 0x01]);
        let mut boxed = vec![0x0a, any.len() as u8];
        boxed.extend_from_slice(&any);
        let (code, message) = try_decode(proto, c"demo.Boxed", &boxed).expect_err("an Any of a type not loaded");
        assert_eq!(code, ISTHMUS_INVALID_ARGUMENT, "{message}");
        assert!(message.contains("demo.Elsewhere"), "{message}");
        assert_eq!(isthmus_proto_free(proto), ISTHMUS_OK);
    }

    #[test]
    fn tables_travel_as_json_through_the_loaded_types() {
        let (proto, _dir) = load();
        // SAFETY: a NUL-terminated path.
        let request = unsafe { isthmus_proto_method_type(proto, c"/demo.Echo/Call".as_ptr(), ISTHMUS_PROTO_REQUEST) };
        // SAFETY: the name lives as long as the proto.
        assert_eq!(unsafe { CStr::from_ptr(request) }, c"demo.Ping");
        // SAFETY: as above.
        let response = unsafe { isthmus_proto_method_type(proto, c"/demo.Echo/Call".as_ptr(), ISTHMUS_PROTO_RESPONSE) };
        // SAFETY: as above.
        assert_eq!(unsafe { CStr::from_ptr(response) }, c"demo.Pong");
        // SAFETY: as above.
        assert!(unsafe { isthmus_proto_method_type(proto, c"/demo.Echo/Nope".as_ptr(), 0) }.is_null());
        // SAFETY: NUL-terminated paths, and a NULL one (refused).
        let streams = |path: &CStr| unsafe { isthmus_proto_method_streams(proto, path.as_ptr()) };
        assert_eq!(streams(c"/demo.Echo/Call"), 0);
        assert_eq!(streams(c"/demo.Echo/Watch"), ISTHMUS_PROTO_SERVER_STREAMING);
        assert_eq!(streams(c"/demo.Echo/Chat"), ISTHMUS_PROTO_CLIENT_STREAMING | ISTHMUS_PROTO_SERVER_STREAMING);
        assert_eq!(streams(c"/demo.Echo/Nope"), -1);
        // SAFETY: NULL is refused before it is read.
        assert_eq!(unsafe { isthmus_proto_method_streams(proto, std::ptr::null()) }, -1);

        // Either field name spelling is read; 64-bit integers as numbers or strings.
        let bytes = encode(proto, c"demo.Ping", r#"{"payload":"aGk=","seq":7,"noteText":"n"}"#).expect("encode");
        let same = encode(proto, c"demo.Ping", r#"{"payload":"aGk=","seq":"7","note_text":"n"}"#).expect("encode");
        assert_eq!(bytes, same);
        let (mut out, mut status) = (std::ptr::null_mut(), std::ptr::null_mut());
        // SAFETY: valid arguments.
        let rc = unsafe {
            isthmus_proto_decode(proto, c"demo.Ping".as_ptr(), bytes.as_ptr(), bytes.len(), &mut out, &mut status)
        };
        assert_eq!(rc, ISTHMUS_OK);
        let json: serde_json::Value = serde_json::from_slice(&take(out)).expect("json");
        assert_eq!(json, serde_json::json!({"payload": "aGk=", "seq": "7", "note_text": "n"}));

        let (code, message) = encode(proto, c"demo.Ping", r#"{"no_such":1}"#).expect_err("unknown field");
        assert_eq!(code, ISTHMUS_INVALID_ARGUMENT);
        assert!(message.contains("no_such"), "{message}");
        assert_eq!(encode(proto, c"demo.Nope", "{}").expect_err("unknown type").0, ISTHMUS_NOT_FOUND);
        assert_eq!(encode(proto, c"demo.Ping", "{} trailing").expect_err("trailing").0, ISTHMUS_INVALID_ARGUMENT);

        // Bytes that are no Ping.
        let junk = [0xffu8, 0xff, 0xff];
        // SAFETY: valid arguments.
        let rc = unsafe {
            isthmus_proto_decode(
                proto,
                c"demo.Ping".as_ptr(),
                junk.as_ptr(),
                junk.len(),
                &mut out,
                std::ptr::null_mut(),
            )
        };
        assert_eq!(rc, ISTHMUS_INVALID_ARGUMENT);
        assert!(out.is_null());

        // The same types from a descriptor set.
        let set = PROTOS.get(proto).expect("live").pool.encode_to_vec();
        let mut again = std::ptr::null_mut();
        // SAFETY: valid bytes and out-pointer.
        let rc =
            unsafe { isthmus_proto_load_descriptor_set(set.as_ptr(), set.len(), &mut again, std::ptr::null_mut()) };
        assert_eq!(rc, ISTHMUS_OK);
        assert_eq!(
            encode(again, c"demo.Ping", r#"{"seq":7}"#).expect("encode"),
            encode(proto, c"demo.Ping", r#"{"seq":7}"#).expect("encode")
        );
        assert_eq!(isthmus_proto_free(again), ISTHMUS_OK);
        assert_eq!(isthmus_proto_free(proto), ISTHMUS_OK);
        assert_eq!(isthmus_proto_free(proto), ISTHMUS_INVALID_ARGUMENT, "a double free is refused");
    }

    #[test]
    fn an_empty_table_is_the_empty_list_or_map_its_field_declares() {
        let (proto, _dir) = load();
        let empty = encode(proto, c"demo.Pong", "{}").expect("an empty message");
        assert!(empty.is_empty());
        // lua-cjson writes every empty Lua table as {}; other encoders write [].
        for json in [r#"{"pings":{}}"#, r#"{"pings":{ }}"#, r#"{"by_name":[]}"#, r#"{"byName":[ ],"pings":[]}"#] {
            assert_eq!(encode(proto, c"demo.Pong", json).expect(json), empty, "{json}");
        }
        // Inside messages, list items and map values too; what is not empty is left alone.
        let nested = r#"{"pings":[{"payload":"aGk=","labels":{}},{"attrs":[],"labels":["x"]}],
            "by_name":{"a":{"labels":{},"attrs":{"k":"v"}}},"first":{"attrs":[],"labels":{}}}"#;
        let plain = r#"{"pings":[{"payload":"aGk="},{"labels":["x"]}],"by_name":{"a":{"attrs":{"k":"v"}}},"first":{}}"#;
        assert_eq!(
            encode(proto, c"demo.Pong", nested).expect("nested"),
            encode(proto, c"demo.Pong", plain).expect("plain")
        );
        // A map given for a list is still refused; so is an unknown name.
        let (code, message) = encode(proto, c"demo.Pong", r#"{"pings":{"x":{}}}"#).expect_err("a map for a list");
        assert_eq!(code, ISTHMUS_INVALID_ARGUMENT);
        assert!(message.contains("expected a list"), "{message}");
        // A list for a map: keys 1..n, holes (null) left out.
        let bytes = encode(proto, c"demo.Pong", r#"{"by_name":[{"seq":1},null,{"seq":3}]}"#).expect("a list for a map");
        assert_eq!(
            decode(proto, c"demo.Pong", &bytes),
            serde_json::json!({"by_name": {"1": {"seq": "1"}, "3": {"seq": "3"}}})
        );
        let (_, message) = encode(proto, c"demo.Pong", r#"{"first":{"nope":{}}}"#).expect_err("unknown");
        assert!(message.contains("nope"), "{message}");
        // An empty table that was fine, beside a field that is not: the error is the field's
        // (it was the empty table's, "expected a list", the reading before the reshape).
        let (_, message) = encode(proto, c"demo.Ping", r#"{"labels":{},"seq":"not a number"}"#).expect_err("a bad seq");
        assert!(!message.contains("expected a list"), "{message}");
        assert_eq!(isthmus_proto_free(proto), ISTHMUS_OK);
    }

    /// `isthmus_proto_load` of `files` with `includes`: the proto, or the failure's message.
    fn load_with(files: &[&std::path::Path], includes: &[&std::path::Path]) -> Result<*mut isthmus_proto_t, String> {
        let c = |p: &&std::path::Path| CString::new(p.to_str().expect("utf8")).expect("cstr");
        let (files, includes): (Vec<CString>, Vec<CString>) =
            (files.iter().map(c).collect(), includes.iter().map(c).collect());
        let (fp, ip): (Vec<_>, Vec<_>) =
            (files.iter().map(|f| f.as_ptr()).collect(), includes.iter().map(|i| i.as_ptr()).collect());
        let (mut proto, mut status) = (std::ptr::null_mut(), std::ptr::null_mut());
        // SAFETY: valid lists of paths and out-pointers.
        let rc = unsafe { isthmus_proto_load(fp.as_ptr(), fp.len(), ip.as_ptr(), ip.len(), &mut proto, &mut status) };
        if rc == ISTHMUS_OK {
            return Ok(proto);
        }
        // SAFETY: a status was stored.
        let message = unsafe { CStr::from_ptr(isthmus_status_message(status)) }.to_string_lossy().into_owned();
        isthmus_status_free(status);
        Err(message)
    }

    #[test]
    fn a_file_outside_the_includes_is_found_in_its_own_directory() {
        let dir = tempdir::Dir::new();
        let (inc, own) = (dir.0.join("inc"), dir.0.join("own"));
        std::fs::create_dir_all(inc.join("shared")).expect("mkdir");
        std::fs::create_dir_all(&own).expect("mkdir");
        std::fs::write(inc.join("shared/common.proto"), "syntax = \"proto3\"; package s; message C { int32 n = 1; }")
            .expect("write");
        let file = own.join("user.proto");
        std::fs::write(
            &file,
            "syntax = \"proto3\"; package u; import \"shared/common.proto\"; message U { s.C c = 1; }",
        )
        .expect("write");
        // protoc would refuse it ("not in any include path"); the import comes from `inc`.
        let proto = load_with(&[&file], &[&inc]).expect("loads");
        assert_eq!(encode(proto, c"u.U", r#"{"c":{"n":5}}"#).expect("encode"), vec![10, 2, 8, 5]);
        assert_eq!(isthmus_proto_free(proto), ISTHMUS_OK);
        // A name relative to an include is found there.
        let proto = load_with(&[std::path::Path::new("shared/common.proto")], &[&inc]).expect("relative");
        assert_eq!(isthmus_proto_free(proto), ISTHMUS_OK);
        // A file that is nowhere says so.
        let message = load_with(&[&own.join("nope.proto")], &[&inc]).expect_err("missing");
        assert!(message.ends_with("nope.proto: no such file"), "{message}");
    }

    #[test]
    fn a_file_that_does_not_compile_says_where() {
        let dir = tempdir::Dir::new();
        let file = dir.0.join("bad.proto");
        std::fs::write(&file, "syntax = \"proto3\";\nmessage M { int32 = 1; }\n").expect("write");
        let path = CString::new(file.to_str().expect("utf8")).expect("cstr");
        let files = [path.as_ptr()];
        let (mut proto, mut status) = (std::ptr::null_mut(), std::ptr::null_mut());
        // SAFETY: valid arguments.
        let rc = unsafe { isthmus_proto_load(files.as_ptr(), 1, std::ptr::null(), 0, &mut proto, &mut status) };
        assert_eq!(rc, ISTHMUS_INVALID_ARGUMENT);
        assert!(proto.is_null());
        // SAFETY: a status was stored.
        let message = unsafe { CStr::from_ptr(isthmus_status_message(status)) }.to_string_lossy().into_owned();
        isthmus_status_free(status);
        assert!(message.contains("bad.proto"), "{message}");
        // SAFETY: a NULL list with a count is refused, not read.
        let rc =
            unsafe { isthmus_proto_load(std::ptr::null(), 2, std::ptr::null(), 0, &mut proto, std::ptr::null_mut()) };
        assert_eq!(rc, ISTHMUS_INVALID_ARGUMENT);
    }

    #[test]
    fn a_descriptor_set_that_makes_prost_reflect_panic_is_refused_not_a_crash() {
        // Found by the capi fuzz target: prost-reflect 0.16.5 indexes past its files while it
        // words the error for this set (descriptor/error.rs:782). The entry point's guard turns
        // the panic into INTERNAL; under the fuzzer (panic=abort) it would abort, so the fuzz
        // target leaves descriptor sets out.
        let set = [0x0a, 0x12, 0x62, 0x10, 0x10, 0x10, 0x10, 0x10, 0x30, 0x10, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0x02];
        let mut proto = std::ptr::null_mut();
        // SAFETY: valid bytes and out-pointer.
        let rc =
            unsafe { isthmus_proto_load_descriptor_set(set.as_ptr(), set.len(), &mut proto, std::ptr::null_mut()) };
        assert_ne!(rc, ISTHMUS_OK);
        assert!(proto.is_null());
    }

    /// A temporary directory, removed when dropped.
    mod tempdir {
        pub(super) struct Dir(pub(super) std::path::PathBuf);

        impl Dir {
            pub(super) fn new() -> Dir {
                static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
                let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let dir = std::env::temp_dir().join(format!("isthmus-proto-test-{}-{n}", std::process::id()));
                std::fs::create_dir_all(&dir).expect("mkdir");
                Dir(dir)
            }
        }

        impl Drop for Dir {
            fn drop(&mut self) {
                let _ = std::fs::remove_dir_all(&self.0);
            }
        }
    }
}
