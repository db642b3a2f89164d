//! Fuzz target: the C ABI's entry points where a caller's bytes come in, with arbitrary
//! bytes: targets for `isthmus_channel_new`, metadata keys and values, method paths, status
//! codes, and handles that are garbage. Each must answer with a code, never crash or leak.
#![no_main]

use std::ffi::CString;

use isthmus_capi::*;

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

    // Garbage handles and codes.
    let word = b.iter().take(8).fold(0usize, |w, x| w << 8 | usize::from(*x));
    let _ = isthmus_message_free(word as *mut isthmus_message_t);
    let _ = isthmus_call_cancel(word as *const isthmus_call_t);
    let _ = isthmus_code_name(word as i32);
    assert_eq!(isthmus_live_handles(), 0);
});
