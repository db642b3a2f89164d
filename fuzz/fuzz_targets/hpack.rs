//! Fuzz target: arbitrary bytes as the header blocks of one HTTP/2 connection, decoded by the
//! `:authority` filter's HPACK decoder and, beside it, by `fluke-hpack` (the decoder it
//! replaced). Ours must never panic; where both decode a block they must agree on every field,
//! which checks the static table, the Huffman code and the dynamic table's evictions.
//! `fluke-hpack` spends ~18 µs on each Huffman-coded string (the reason for ADR 0035), so it
//! sees only blocks of a few fields, and a connection's blocks after one it did not see go to
//! ours alone (its dynamic table would differ from there): runs reach millions.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    // fluke-hpack panics on some malformed blocks instead of returning its error: such a panic
    // counts as its error. Any other panic reaches libfuzzer's hook and fails the run.
    static HOOK: std::sync::Once = std::sync::Once::new();
    HOOK.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if !info.location().is_some_and(|l| l.file().contains("fluke-hpack")) {
                previous(info);
            }
        }));
    });
    let Some((&step, rest)) = data.split_first() else { return };
    let mut ours = isthmus::fuzz::Hpack::default();
    let mut theirs = fluke_hpack::Decoder::new();
    theirs.set_max_allowed_table_size(4096);
    let mut compared = true;
    for block in rest.chunks(usize::from(step).max(1)) {
        let mine = ours.decode(block);
        compared &= mine.as_ref().is_some_and(|fields| fields.len() <= COMPARED_FIELDS);
        if !compared {
            if mine.is_none() {
                return;
            }
            continue;
        }
        let other = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| theirs.decode(block)));
        match (mine, other) {
            (Some(mine), Ok(Ok(other))) => assert_eq!(mine, other, "the decoders disagree on {block:02x?}"),
            // Either refused the block: the connection would end here.
            _ => return,
        }
    }
});

/// The most fields a block `fluke-hpack` decodes too may have: two strings each at most.
const COMPARED_FIELDS: usize = 8;
