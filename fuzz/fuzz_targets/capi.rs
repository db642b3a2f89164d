//! Fuzz target: the C ABI's entry points where a caller's bytes come in, with arbitrary
//! bytes: targets and channel options (a user agent, sizes, flags, keepalive times) for
//! `isthmus_channel_new`, metadata keys and values, method paths, status codes, JSON and
//! protobuf bytes for `isthmus_proto_encode`/`_decode`, and handles that are
//! garbage (also for the block calls, `isthmus_channel_alloc`, `isthmus_block_write`,
//! `isthmus_block_truncate` and
//! `isthmus_unary_block`, the connectivity calls, the counters, the topics,
//! `isthmus_server_call_reply_async` and `isthmus_server_call_begin`). Each must answer with a
//! code, never crash or leak.
//!
//! Over a live connection too (one `shm://` server and channel for the whole run): a block of
//! a caller's size (`isthmus_channel_alloc`), and a unary call with a caller's path, request,
//! metadata, flags and timeout, which the server's handler finishes with the code and message
//! the request asks for (gRPC codes, and numbers that are none).
#![no_main]

use std::ffi::{c_void, CString};
use std::sync::atomic::AtomicUsize;
use std::sync::atomic::Ordering::SeqCst;

use isthmus_capi::*;

/// One proto, compiled once (its handle lives for the whole run): the types the JSON and
/// protobuf inputs go through.
fn proto() -> *const isthmus_proto_t {
    static PROTO: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *PROTO.get_or_init(|| {
        let dir = std::env::temp_dir().join(format!("isthmus-fuzz-capi-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("mkdir");
        let file = dir.join("f.proto");
        let text = "syntax = \"proto3\"; package f; enum E { A = 0; B = 1; }\n\
                    message M { bytes b = 1; uint64 u = 2; string s = 3; repeated M kids = 4;\n\
                    map<string, int32> m = 5; E e = 6; double d = 7; oneof o { sint64 x = 8; M y = 9; } }";
        std::fs::write(&file, text).expect("write");
        let path = CString::new(file.to_str().expect("utf8")).expect("cstr");
        let mut p = std::ptr::null_mut();
        // SAFETY: one valid path, a valid out-pointer.
        let code = unsafe {
            isthmus_proto_load([path.as_ptr()].as_ptr(), 1, std::ptr::null(), 0, &mut p, std::ptr::null_mut())
        };
        assert_eq!(code, ISTHMUS_OK);
        let _ = std::fs::remove_dir_all(&dir);
        p as usize
    }) as *const isthmus_proto_t
}

/// What the live connection still owes the target after its client's call returned: handlers
/// still running (one frees a refused finish's status after the client has its answer) and
/// replies whose event is yet to come on the queue (one that failed carries a status). The
/// handle count is checked once this is zero: checked sooner, it raced them.
static OWED: AtomicUsize = AtomicUsize::new(0);

/// The tag of the handler's replies on the live queue: the events [`drain`] counts off [`OWED`].
const REPLY_TAG: u64 = 1;

/// One running handler, in [`OWED`] until it returns.
struct Running;

impl Running {
    fn new() -> Running {
        OWED.fetch_add(1, SeqCst);
        Running
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        OWED.fetch_sub(1, SeqCst);
    }
}

/// The live server's one handler (`/f.S/M`): ends each call with the code its request's first
/// byte asks for (minus 8: gRPC codes, and numbers that are none), and the rest of the request
/// as the message; OK replies with the request itself, through `user_data`'s queue.
extern "C" fn finish_as_asked(user_data: *mut c_void, call: *mut isthmus_server_call_t) {
    let _running = Running::new();
    let (mut md, mut left) = (std::ptr::null_mut(), 0i64);
    // SAFETY: an event is plain integers and pointers: all zero is a valid one (no handles).
    let mut now: isthmus_event_t = unsafe { std::mem::zeroed() };
    // SAFETY: the library's live call; every out-pointer is a valid local.
    let begun = unsafe { isthmus_server_call_begin(call, &mut md, &mut left, &mut now) };
    if !md.is_null() {
        assert_eq!(isthmus_metadata_free(md), ISTHMUS_OK);
    }
    let asked = match (begun, now.message_data.is_null()) {
        // SAFETY: the event's message bytes are valid until the message is freed, below.
        (1, false) => unsafe { std::slice::from_raw_parts(now.message_data, now.message_len) }.to_vec(),
        _ => Vec::new(),
    };
    if !now.message.is_null() {
        assert_eq!(isthmus_message_free(now.message), ISTHMUS_OK);
    }
    if !now.status.is_null() {
        assert_eq!(isthmus_status_free(now.status), ISTHMUS_OK);
    }
    let code = asked.first().map_or(0, |c| i32::from(*c) - 8);
    if code == ISTHMUS_OK {
        let (cq, mut status) = (user_data as *const isthmus_cq_t, std::ptr::null_mut());
        // SAFETY: as above; the reply is a live slice; the queue lives for the whole run.
        let replied = unsafe {
            isthmus_server_call_reply_async(
                call,
                asked.as_ptr(),
                asked.len(),
                std::ptr::null(),
                cq,
                REPLY_TAG,
                &mut now,
                &mut status,
            )
        };
        if replied != ISTHMUS_OK {
            assert_eq!(isthmus_status_free(status), ISTHMUS_OK);
        } else if now.op == 0 {
            OWED.fetch_add(1, SeqCst); // its event comes on the queue, taken by `drain`
        } else if !now.status.is_null() {
            assert_eq!(isthmus_status_free(now.status), ISTHMUS_OK);
        }
        return;
    }
    let text = CString::new(asked.iter().skip(1).copied().filter(|c| *c != 0).collect::<Vec<u8>>()).unwrap_or_default();
    let mut status = std::ptr::null_mut();
    // SAFETY: the live call, finished once here; `text` is NUL-terminated; a valid out-pointer.
    if unsafe { isthmus_server_call_finish(call, code, text.as_ptr(), std::ptr::null(), &mut status) } != ISTHMUS_OK {
        assert_eq!(isthmus_status_free(status), ISTHMUS_OK);
    }
}

/// The live connection: a server answering `/f.S/M` with [`finish_as_asked`] on `shm://`, a
/// channel connected to it, and the queue its replies that wait complete on. All live for the
/// whole run.
fn live() -> (*const isthmus_channel_t, *const isthmus_cq_t) {
    static LIVE: std::sync::OnceLock<(usize, usize)> = std::sync::OnceLock::new();
    let (channel, cq) = *LIVE.get_or_init(|| {
        let cq = isthmus_cq_new();
        assert!(!cq.is_null());
        // SAFETY: NULL options are the defaults.
        let server = unsafe { isthmus_server_new(std::ptr::null()) };
        assert!(!server.is_null());
        let handler: isthmus_handler_fn = Some(finish_as_asked);
        // SAFETY: a live server, a NUL-terminated path, a handler whose user data is the queue.
        let code =
            unsafe { isthmus_server_add_handler(server, c"/f.S/M".as_ptr(), handler, cq.cast(), std::ptr::null_mut()) };
        assert_eq!(code, ISTHMUS_OK);
        let dir = std::env::temp_dir().join(format!("isthmus-fuzz-capi-live-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("mkdir");
        let target = CString::new(format!("shm://{}/s.sock", dir.display())).expect("cstr");
        // SAFETY: one NUL-terminated target.
        let code = unsafe { isthmus_server_start(server, [target.as_ptr()].as_ptr(), 1, std::ptr::null_mut()) };
        assert_eq!(code, ISTHMUS_OK);
        let mut channel = std::ptr::null_mut();
        // SAFETY: a NUL-terminated target, a valid out-pointer.
        let code =
            unsafe { isthmus_channel_new(target.as_ptr(), std::ptr::null(), &mut channel, std::ptr::null_mut()) };
        assert_eq!(code, ISTHMUS_OK);
        // Connected by a first call; then the socket goes, so that nothing is left behind when
        // the run ends (libFuzzer exits without dropping anything). The connection lives on.
        let (mut reply, none) = (std::ptr::null_mut(), std::ptr::null_mut());
        // SAFETY: a live channel, a NUL-terminated path, a one-byte request, valid out-pointers.
        let code = unsafe {
            let request = [8u8]; // code 0: OK
            let path = c"/f.S/M".as_ptr();
            isthmus_unary(
                channel,
                path,
                request.as_ptr(),
                1,
                std::ptr::null(),
                &mut reply,
                none,
                none,
                std::ptr::null_mut(),
            )
        };
        assert_eq!(code, ISTHMUS_OK, "the live server answers");
        assert_eq!(isthmus_message_free(reply), ISTHMUS_OK);
        std::fs::remove_dir_all(&dir).expect("rm");
        (channel as usize, cq as usize)
    });
    (channel as *const isthmus_channel_t, cq as *const isthmus_cq_t)
}

/// A unary call over the live connection with a caller's path, request, metadata, flags and
/// timeout; every handle it gives back is freed.
fn call_live(text: &CString, b: &[u8]) {
    let (live, cq) = live();
    let byte = |i: usize| b.get(i).copied().unwrap_or(0);
    // A block of a caller's size, up to `usize::MAX`: refused, or given, cut to a caller's
    // length (refused past its own) and freed. Its timeout bounds the wait for room in a full
    // arena.
    let size = b.iter().skip(10).take(8).fold(0usize, |w, x| w << 8 | usize::from(*x));
    let opts = isthmus_call_options_t { timeout_us: 1000, metadata: std::ptr::null(), flags: 0 };
    let (mut block, mut status) = (std::ptr::null_mut(), std::ptr::null_mut());
    // SAFETY: a live channel, valid options and out-pointers.
    match unsafe { isthmus_channel_alloc(live, size, &opts, &mut block, &mut status) } {
        ISTHMUS_OK => {
            let cut = usize::from(byte(19)) << 8 | usize::from(byte(20));
            let mut refused = std::ptr::null_mut();
            // SAFETY: a live block and a valid out-pointer.
            let rc = unsafe { isthmus_block_truncate(block, cut, &mut refused) };
            if cut > size {
                assert_eq!(rc, ISTHMUS_INVALID_ARGUMENT, "a block never grows");
                assert_eq!(isthmus_status_free(refused), ISTHMUS_OK);
            } else {
                assert_eq!(rc, ISTHMUS_OK);
                let mut len = usize::MAX;
                // SAFETY: a live block and a writable length.
                let _ = unsafe { isthmus_block_data(block, &mut len) };
                assert_eq!(len, cut);
            }
            assert_eq!(isthmus_block_free(block), ISTHMUS_OK);
        }
        _ => assert_eq!(isthmus_status_free(status), ISTHMUS_OK),
    }
    // The call. Its timeout is none, negative (none) or long: the server always answers first,
    // so no call of the server's is left when the call returns.
    let timeout_us = match byte(18) {
        x @ 0..128 => -i64::from(x),
        x => i64::from(x) * 1_000_000,
    };
    let flags = b.iter().skip(19).take(4).fold(0u32, |w, x| w << 8 | u32::from(*x));
    let md = isthmus_metadata_new();
    let mut status = std::ptr::null_mut();
    // SAFETY: `text` is NUL-terminated, `b` is a live slice, `status` a valid local.
    if unsafe { isthmus_metadata_add(md, text.as_ptr(), b.as_ptr(), b.len().min(64), &mut status) } != ISTHMUS_OK {
        assert_eq!(isthmus_status_free(status), ISTHMUS_OK);
    }
    let opts = isthmus_call_options_t { timeout_us, metadata: md, flags };
    let path = if byte(1) & 1 == 0 { c"/f.S/M".as_ptr() } else { text.as_ptr() };
    let (mut reply, mut headers, mut trailers, mut status) =
        (std::ptr::null_mut(), std::ptr::null_mut(), std::ptr::null_mut(), std::ptr::null_mut());
    // SAFETY: a live channel, a NUL-terminated path, a live request slice, valid options and
    // out-pointers.
    let code = unsafe {
        isthmus_unary(live, path, b.as_ptr(), b.len(), &opts, &mut reply, &mut headers, &mut trailers, &mut status)
    };
    assert_eq!(code == ISTHMUS_OK, status.is_null(), "a status exactly for a failure");
    for md in [headers, trailers] {
        if !md.is_null() {
            assert_eq!(isthmus_metadata_free(md), ISTHMUS_OK);
        }
    }
    if !reply.is_null() {
        assert_eq!(isthmus_message_free(reply), ISTHMUS_OK);
    }
    if !status.is_null() {
        assert_eq!(isthmus_status_free(status), ISTHMUS_OK);
    }
    assert_eq!(isthmus_metadata_free(md), ISTHMUS_OK);
    drain(cq);
}

/// Takes the events of the handler's replies that had to wait (a status at most) off `cq`.
fn drain(cq: *const isthmus_cq_t) {
    // SAFETY: an event is plain integers and pointers: all zero is a valid one (no handles).
    let mut events: [isthmus_event_t; 4] = unsafe { std::mem::zeroed() };
    // SAFETY: room for 4 events.
    while let n @ 1.. = unsafe { isthmus_cq_poll(cq, events.as_mut_ptr(), events.len()) } {
        for ev in &events[..n] {
            if !ev.status.is_null() {
                assert_eq!(isthmus_status_free(ev.status), ISTHMUS_OK);
            }
            if ev.tag == REPLY_TAG {
                OWED.fetch_sub(1, SeqCst);
            }
        }
    }
}

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let cut = data.first().map_or(0, |b| usize::from(*b)).min(data.len().saturating_sub(1));
    let (a, b) = data.get(1..).unwrap_or_default().split_at(cut.min(data.len().saturating_sub(1)));
    let text = CString::new(a.iter().copied().filter(|c| *c != 0).collect::<Vec<u8>>()).unwrap_or_default();

    // A target from a caller: parsed (or refused) without connecting anywhere.
    let mut channel = std::ptr::null_mut();
    let mut status = std::ptr::null_mut();
    // SAFETY: `text` is NUL-terminated; the out-pointers are valid locals.
    let code = unsafe { isthmus_channel_new(text.as_ptr(), std::ptr::null(), &mut channel, &mut status) };
    if code == ISTHMUS_OK {
        // Not asked to connect, a new channel is IDLE and stays so.
        let mut state = u32::MAX;
        // SAFETY: a live channel and a valid out-pointer.
        assert_eq!(unsafe { isthmus_channel_state(channel, 0, &mut state) }, ISTHMUS_OK);
        assert_eq!(state, ISTHMUS_STATE_IDLE);
        // Its calls ended with a code and message from a caller: valid ones, and others.
        let code = i32::from(b.first().copied().unwrap_or(0)) - 8;
        let mut status = std::ptr::null_mut();
        // SAFETY: a live channel; `text` is NUL-terminated; a valid out-pointer.
        match unsafe { isthmus_channel_shutdown(channel, code, text.as_ptr(), &mut status) } {
            ISTHMUS_OK => assert!((1..=16).contains(&code)),
            _ => assert_eq!(isthmus_status_free(status), ISTHMUS_OK),
        }
        assert_eq!(isthmus_channel_close(channel), ISTHMUS_OK);
    } else {
        assert_eq!(isthmus_status_free(status), ISTHMUS_OK);
    }

    // Channel options from a caller: a user agent and an authority (any bytes but NUL; `text`,
    // each present or not by a bit of byte 29), sizes, flags (known bits and others) and
    // keepalive times and a connect timeout, for a target that parses (shm://, or HTTP/2 by byte 30, where an
    // authority is checked the way calls send it). Checked when the channel is made: it is
    // refused with a status, or made IDLE.
    // Each field from bytes of its own (after the first, which picks the shutdown's code).
    let word = |at: usize, n: usize| b.iter().skip(at).take(n).fold(0u64, |w, x| w << 8 | u64::from(*x));
    let options = isthmus_channel_options_t {
        max_message_size: word(1, 8),
        tls: std::ptr::null(),
        flags: word(9, 4) as u32,
        keepalive_time_ms: word(13, 8),
        keepalive_timeout_ms: word(21, 8),
        user_agent: if b.get(29).is_some_and(|x| x & 1 == 1) { std::ptr::null() } else { text.as_ptr() },
        authority: if b.get(29).is_some_and(|x| x & 2 == 2) { std::ptr::null() } else { text.as_ptr() },
        connect_timeout_ms: word(31, 8),
    };
    let mut channel = std::ptr::null_mut();
    let mut status = std::ptr::null_mut();
    let target = if b.get(30).is_some_and(|x| x & 1 == 1) { c"http://127.0.0.1:9" } else { c"shm://isthmus-fuzz-none" };
    // SAFETY: a NUL-terminated target, options whose agent and authority are NUL-terminated or
    // NULL, valid out-pointers.
    let code = unsafe { isthmus_channel_new(target.as_ptr(), &options, &mut channel, &mut status) };
    if code == ISTHMUS_OK {
        let mut state = u32::MAX;
        // SAFETY: a live channel and a valid out-pointer.
        assert_eq!(unsafe { isthmus_channel_state(channel, 0, &mut state) }, ISTHMUS_OK);
        assert_eq!(state, ISTHMUS_STATE_IDLE);
        assert_eq!(isthmus_channel_close(channel), ISTHMUS_OK);
    } else {
        assert_ne!(code, ISTHMUS_INTERNAL, "options from a caller are refused, not a fault");
        assert_eq!(isthmus_status_free(status), ISTHMUS_OK);
    }

    // Metadata keys and values from a caller.
    let md = isthmus_metadata_new();
    let mut status = std::ptr::null_mut();
    // SAFETY: `text` is NUL-terminated, `b` is a live slice, `status` a valid local.
    if unsafe { isthmus_metadata_add(md, text.as_ptr(), b.as_ptr(), b.len(), &mut status) } != ISTHMUS_OK {
        assert_eq!(isthmus_status_free(status), ISTHMUS_OK);
    }
    for i in 0..=isthmus_metadata_len(md) {
        let (mut k, mut kl, mut v, mut vl) = (std::ptr::null(), 0, std::ptr::null(), 0);
        // SAFETY: every out-pointer is a valid local.
        let _ = unsafe { isthmus_metadata_get(md, i, &mut k, &mut kl, &mut v, &mut vl) };
    }
    assert_eq!(isthmus_metadata_free(md), ISTHMUS_OK);
    assert_ne!(isthmus_metadata_free(md), ISTHMUS_OK); // a double free is refused

    // JSON and protobuf bytes from a caller, through the proto's types; a descriptor set.
    let proto = proto();
    let mut out = std::ptr::null_mut();
    // SAFETY: valid name, a live slice, a valid out-pointer.
    if unsafe { isthmus_proto_encode(proto, c"f.M".as_ptr(), b.as_ptr(), b.len(), &mut out, std::ptr::null_mut()) }
        == ISTHMUS_OK
    {
        let mut len = 0;
        // SAFETY: a live handle; its bytes stay valid until it is freed.
        let bytes = unsafe { std::slice::from_raw_parts(isthmus_message_data(out, &mut len), len) }.to_vec();
        assert_eq!(isthmus_message_free(out), ISTHMUS_OK);
        // What encoding gave decodes again.
        // SAFETY: as above.
        let code = unsafe {
            isthmus_proto_decode(proto, c"f.M".as_ptr(), bytes.as_ptr(), bytes.len(), &mut out, std::ptr::null_mut())
        };
        assert_eq!(code, ISTHMUS_OK);
        assert_eq!(isthmus_message_free(out), ISTHMUS_OK);
    }
    // SAFETY: as above.
    if unsafe { isthmus_proto_decode(proto, c"f.M".as_ptr(), b.as_ptr(), b.len(), &mut out, std::ptr::null_mut()) }
        == ISTHMUS_OK
    {
        assert_eq!(isthmus_message_free(out), ISTHMUS_OK);
    }
    // SAFETY: `text` is NUL-terminated.
    let _ = unsafe { isthmus_proto_method_type(proto, text.as_ptr(), 0) };
    // SAFETY: as above.
    let _ = unsafe { isthmus_proto_method_streams(proto, text.as_ptr()) };
    // Not `isthmus_proto_load_descriptor_set`: prost-reflect 0.16 panics on some malformed sets
    // (a unit test in proto.rs keeps one); the entry point's guard makes that INTERNAL, but
    // under the fuzzer a panic aborts.

    // Garbage handles and codes.
    let word = b.iter().take(8).fold(0usize, |w, x| w << 8 | usize::from(*x));
    let _ = isthmus_message_free(word as *mut isthmus_message_t);
    let _ = isthmus_call_cancel(word as *const isthmus_call_t);
    // SAFETY: an event is plain integers and pointers: all zero is a valid one (no handles).
    let mut now: isthmus_event_t = unsafe { std::mem::zeroed() };
    // SAFETY: garbage handles are the point; `now` is a valid local, the status pointer NULL.
    let _ = unsafe {
        isthmus_call_recv_spin(
            word as *const isthmus_call_t,
            word as *const isthmus_cq_t,
            1,
            &mut now,
            std::ptr::null_mut(),
        )
    };
    // SAFETY: as above; the message is `b`, a live slice.
    let _ = unsafe {
        isthmus_server_call_reply_async(
            word as *mut isthmus_server_call_t,
            b.as_ptr(),
            b.len(),
            word as *const isthmus_metadata_t,
            word as *const isthmus_cq_t,
            1,
            &mut now,
            std::ptr::null_mut(),
        )
    };
    // SAFETY: a garbage handle is the point; the name is a NUL-terminated literal.
    let _ = unsafe {
        isthmus_server_call_set_compression(
            word as *const isthmus_server_call_t,
            c"gzip".as_ptr(),
            std::ptr::null_mut(),
        )
    };
    // SAFETY: garbage handles are the point; `now` is a valid local, the status pointer NULL.
    let _ = unsafe {
        isthmus_channel_wait_state_async(
            word as *const isthmus_channel_t,
            u32::from(b.first().copied().unwrap_or(0)),
            i64::from(b.get(1).copied().unwrap_or(0)),
            word as *const isthmus_cq_t,
            2,
            &mut now,
            std::ptr::null_mut(),
        )
    };
    // SAFETY: a garbage queue is the point; `tag` and `taken` are valid locals.
    let (mut tag, mut taken) = (0u64, std::ptr::null_mut());
    let _ = unsafe { isthmus_cq_take_call(word as *const isthmus_cq_t, 1, &mut tag, &mut taken, std::ptr::null_mut()) };
    let _ = isthmus_server_call_headers_sent(word as *const isthmus_server_call_t);
    assert_eq!(isthmus_server_call_half_closed(word as *const isthmus_server_call_t), 0, "a garbage call is open");
    let (mut md, mut left) = (std::ptr::null_mut(), 0i64);
    // SAFETY: a garbage handle is the point; every pointer argument is a valid local.
    let begun =
        unsafe { isthmus_server_call_begin(word as *const isthmus_server_call_t, &mut md, &mut left, &mut now) };
    assert!(begun == -1 && md.is_null(), "a garbage call begins nothing");
    let _ = isthmus_code_name(word as i32);
    let (mut block, mut reply) = (std::ptr::null_mut(), std::ptr::null_mut());
    // SAFETY: garbage handles are the point; every pointer argument is a valid local or NULL.
    unsafe {
        let _ = isthmus_channel_alloc(
            word as *const isthmus_channel_t,
            64,
            std::ptr::null(),
            &mut block,
            std::ptr::null_mut(),
        );
        let mut state = 0;
        let _ = isthmus_channel_state(word as *const isthmus_channel_t, 1, &mut state);
        let last = u32::from(b.get(8).copied().unwrap_or(0));
        let _ = isthmus_channel_wait_state(word as *const isthmus_channel_t, last, 0, &mut state);
        let (channel, block) = (word as *const isthmus_channel_t, word as *mut isthmus_block_t);
        let _ = isthmus_block_write(block, word as usize, b.as_ptr(), b.len(), std::ptr::null_mut());
        let _ = isthmus_block_truncate(block, word as usize, std::ptr::null_mut());
        let (none, path) = (std::ptr::null_mut(), text.as_ptr());
        let _ =
            isthmus_unary_block(channel, path, block, std::ptr::null(), &mut reply, none, none, std::ptr::null_mut());
    }
    // Counters into a caller's buffer of a caller's size (the library writes no more than its
    // own struct's).
    let mut buffer = [0u64; 64];
    let size = usize::from(b.get(9).copied().unwrap_or(0)) * 2;
    // SAFETY: `buffer` is writable for 512 bytes, more than `size`; the handles are garbage.
    unsafe {
        let out = buffer.as_mut_ptr().cast::<isthmus_stats_t>();
        let _ = isthmus_channel_stats(word as *const isthmus_channel_t, out, size);
        let _ = isthmus_server_stats(word as *const isthmus_server_t, out, size);
        let topic = word as *const isthmus_topic_t;
        let _ = isthmus_topic_publish(topic, b.as_ptr(), b.len(), std::ptr::null_mut(), std::ptr::null_mut());
        let _ = isthmus_topic_stats(topic, buffer.as_mut_ptr().cast(), size);
        let _ = isthmus_topic_close(topic);
        let _ = isthmus_topic_free(word as *mut isthmus_topic_t);
    }
    call_live(&text, b);
    // The proto, the live server, its channel and queue, once the connection owes nothing: a
    // handler may still run after its client has the answer (a finish whose message is not
    // UTF-8 ends the call INTERNAL first, then gives the handler the refusal to free), and a
    // reply's event may come after the drain above, with a status if the reply failed.
    let (since, (_, cq)) = (std::time::Instant::now(), live());
    while OWED.load(SeqCst) != 0 {
        assert!(since.elapsed() < std::time::Duration::from_secs(60), "a handler or a reply's event never ended");
        drain(cq);
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    assert_eq!(isthmus_live_handles(), 4);
});
