//! Fuzz target: arbitrary bytes as the header blocks of one HTTP/2 connection, decoded by the
//! `:authority` filter's HPACK decoder and, beside it, by `fluke-hpack` (the decoder it
//! replaced). Ours must never panic; where both decode a block they must agree on every field,
//! which checks the static table, the Huffman code and the dynamic table's evictions.
//! `fluke-hpack` builds its Huffman tables for each Huffman-coded string (~18 µs, far more under
//! AddressSanitizer; the reason for ADR 0035), so it sees only a connection's first few fields
//! and bytes, and the blocks after go to ours alone (its dynamic table would differ from there
//! on): runs reach millions. A third decoder follows each block in pieces, as the filter
//! follows a block too large to hold, and must hand on the same fields. Two more, with a
//! 64-byte table (so that short strings count as too long to hold), decode each block whole and
//! past a 64-byte bound: the second must hand on the first's fields up to the bound, count the
//! same list, and refuse the same blocks.
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
    let mut in_pieces = isthmus::fuzz::Hpack::default();
    let (mut small, mut bounded) = (isthmus::fuzz::Hpack::with_table(64), isthmus::fuzz::Hpack::with_table(64));
    let mut theirs = fluke_hpack::Decoder::new();
    theirs.set_max_allowed_table_size(4096);
    let (mut compared, mut fields, mut bytes) = (true, 0, 0);
    for block in rest.chunks(usize::from(step).max(1)) {
        // Either decoder refusing a block ends the connection here.
        let decoded = ours.decode(block);
        let followed = in_pieces.follow(block, usize::from(step % 7) + 1);
        assert_eq!(decoded, followed, "decoded whole and in pieces, {block:02x?}");
        let whole = small.decode_bounded(block, usize::MAX);
        let past = bounded.decode_bounded(block, 64);
        assert_eq!(whole.is_some(), past.is_some(), "decoded whole and past a bound, {block:02x?}");
        if let (Some((all, list)), Some((before, counted))) = (&whole, &past) {
            assert_eq!((&all[..before.len()], list), (&before[..], counted), "past a bound, {block:02x?}");
        }
        let Some(mine) = decoded else { return };
        fields += mine.len();
        bytes += block.len();
        compared &= fields <= COMPARED_FIELDS && bytes <= COMPARED_BYTES;
        if !compared {
            continue;
        }
        match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| theirs.decode(block))) {
            Ok(Ok(other)) => assert_eq!(mine, other, "the decoders disagree on {block:02x?}"),
            _ => return,
        }
    }
});

/// The most fields (two strings each at most) and bytes of a connection that `fluke-hpack`
/// decodes too.
const COMPARED_FIELDS: usize = 16;
const COMPARED_BYTES: usize = 512;
