//! Fuzz target: the C ABI's entry points where a caller's bytes come in, with arbitrary
//! bytes: targets for `isthmus_channel_new`, metadata keys and values, method paths, status
//! codes, JSON and protobuf bytes for `isthmus_proto_encode`/`_decode`, and handles that are
//! garbage (also for the block calls, `isthmus_channel_alloc`, `isthmus_block_write` and
//! `isthmus_unary_block`, the connectivity calls, the counters, the topics,
//! `isthmus_server_call_reply_async` and `isthmus_server_call_begin`). Each must answer with a
//! code, never crash or leak.
#![no_main]

use std::ffi::CString;

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
    assert_eq!(isthmus_live_handles(), 1); // the proto
});
