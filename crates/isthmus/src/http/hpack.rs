//! An HPACK decoder (RFC 7541) for the `:authority` filter: it follows a client's dynamic table
//! and hands each header field of a block to a callback.
//!
//! The client is untrusted, so the decoder's work is bounded by what it is sent: the caller
//! gives the largest header list it takes (counted as HTTP/2 counts it: name, value and 32 per
//! field) and stops handing fields on the moment one would pass it, before the field's strings
//! are copied or inflated; the rest of such a block is followed without being held
//! ([`Overflow`]), so one call's oversized metadata need not end its connection. A Huffman-coded string is decoded bit by bit with
//! the code's canonical form (per code length, its first code and where its symbols start), in
//! time proportional to its bits and with no table built per string. (The decoder used before,
//! `fluke-hpack`, built two levels of hash maps for every Huffman string: a 1 MB block of empty
//! Huffman strings took a server 12 s of CPU.) Integers and table-size updates are held to what
//! h2 accepts, so a block h2 would decode decodes here too.

use std::collections::VecDeque;
use std::sync::Arc;

/// Why a header block does not decode; the connection ends.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Error {
    /// A representation, integer or string runs past the end of the block.
    Truncated,
    /// An integer with more continuation bytes than h2 takes, or too large for its use.
    Integer,
    /// An index of no entry (0, or past the static and dynamic tables).
    Index(usize),
    /// A Huffman string with the EOS symbol in it, or padding that is not EOS's first bits.
    Huffman,
    /// A table-size update after a field, or to more than the size allowed.
    TableSize(usize),
    /// The decoded list would pass the caller's bound.
    TooLarge,
}

/// What HTTP/2 counts per header field beside its name and value (RFC 7540 §6.5.2), and HPACK
/// per dynamic table entry (RFC 7541 §4.1).
pub(crate) const FIELD_OVERHEAD: usize = 32;

/// A decoder following one connection's dynamic table.
pub(crate) struct Decoder {
    /// The newest entry first (index 62). A name is shared: a field that names an entry's name
    /// and is indexed again costs a client two bytes, and must not cost a copy of the name.
    table: VecDeque<(Arc<[u8]>, Vec<u8>)>,
    /// The entries' sizes, each name + value + 32.
    size: usize,
    /// The table's size now, as the client's last size update set it.
    max_size: usize,
    /// The most a size update may set (the SETTINGS_HEADER_TABLE_SIZE the server announces).
    allowed: usize,
}

impl Decoder {
    /// A decoder whose client may use a dynamic table of up to `allowed` bytes.
    pub(crate) fn new(allowed: usize) -> Decoder {
        Decoder { table: VecDeque::new(), size: 0, max_size: allowed, allowed }
    }

    /// Decodes one header block, calling `field` with each field's name and value in order
    /// while the list stays within `bound` bytes. A list that passes it is followed to the
    /// block's end without being held ([`Overflow`]), so the table stays the client's and the
    /// connection can go on. After an error the decoder's table is in no known state: the
    /// connection must end.
    pub(crate) fn decode(
        &mut self,
        block: &[u8],
        bound: usize,
        mut field: impl FnMut(&[u8], &[u8]),
    ) -> Result<Outcome, Error> {
        let mut progress = Progress::default();
        match self.decode_within(block, bound, &mut field, &mut progress) {
            Ok(()) => Ok(Outcome::Within),
            Err(Error::TooLarge) => {
                // The field that passed the bound changed nothing yet: follow it and the rest.
                let mut over =
                    Overflow { list: progress.list, fields_seen: progress.fields_seen, ..Overflow::default() };
                over.feed(self, &block[progress.start..], |_, _| ())?;
                Ok(Outcome::Over(over))
            }
            Err(e) => Err(e),
        }
    }

    /// [`Decoder::decode`] up to the field that passes `bound`, where `progress` says where it
    /// began and what the list held before it.
    fn decode_within(
        &mut self,
        block: &[u8],
        bound: usize,
        field: &mut impl FnMut(&[u8], &[u8]),
        progress: &mut Progress,
    ) -> Result<(), Error> {
        let mut at = 0;
        let mut list = 0usize;
        let mut fields_seen = false;
        // A literal's name and value, decoded.
        let (mut name, mut value) = (Vec::new(), Vec::new());
        while let Some(&first) = block.get(at) {
            *progress = Progress { start: at, list, fields_seen };
            if first & 0x80 != 0 {
                // Indexed field.
                let (index, n) = integer(&block[at..], 7)?;
                at += n;
                let (name, value) = self.entry(index)?;
                list = within(list, name.len() + value.len(), bound)?;
                field(name, value);
            } else if first & 0xe0 == 0x20 {
                // Dynamic table size update: only before the block's first field (as h2).
                let (size, n) = integer(&block[at..], 5)?;
                at += n;
                self.size_update(size, fields_seen)?;
                continue;
            } else {
                // A literal: with incremental indexing (01), or without (0000) or never (0001)
                // indexed, its name indexed or new.
                let indexing = first & 0x40 != 0;
                let (index, n) = integer(&block[at..], literal_prefix(indexing))?;
                at += n;
                name.clear();
                value.clear();
                // An indexed name is at most the table's size; a new one, and the value, are
                // held to what is left of the bound as they are read.
                if index == 0 {
                    at += string(&block[at..], &mut name, bound - list)?;
                } else {
                    name.extend_from_slice(self.entry(index)?.0);
                }
                at += string(&block[at..], &mut value, (bound - list).saturating_sub(name.len()))?;
                list = within(list, name.len() + value.len(), bound)?;
                field(&name, &value);
                if indexing {
                    self.insert(&name, &value);
                }
            }
            fields_seen = true;
        }
        Ok(())
    }

    /// A dynamic table size update, allowed only before a block's first field (as h2).
    fn size_update(&mut self, size: usize, fields_seen: bool) -> Result<(), Error> {
        if fields_seen || size > self.allowed {
            return Err(Error::TableSize(size));
        }
        self.max_size = size;
        self.evict(0);
        Ok(())
    }

    /// A string longer than this, encoded, is never held by an [`Overflow`]: even Huffman-coded
    /// (at most 30 bits a byte) it decodes to more than the whole table, so an entry made of it
    /// only empties the table.
    fn long_string(&self) -> usize {
        self.allowed * 4 + 64
    }

    /// The entry at HPACK index `index` (1-61 static, 62 on the dynamic table).
    fn entry(&self, index: usize) -> Result<(&[u8], &[u8]), Error> {
        match index {
            0 => Err(Error::Index(0)),
            i if i <= STATIC.len() => {
                let (n, v) = STATIC[i - 1];
                Ok((n.as_bytes(), v.as_bytes()))
            }
            i => self.table.get(i - STATIC.len() - 1).map(|(n, v)| (&n[..], &v[..])).ok_or(Error::Index(i)),
        }
    }

    /// The name of the entry at HPACK index `index`, shared.
    fn entry_name(&self, index: usize) -> Result<Arc<[u8]>, Error> {
        match index {
            i if i > STATIC.len() => {
                self.table.get(i - STATIC.len() - 1).map(|(n, _)| n.clone()).ok_or(Error::Index(i))
            }
            i => self.entry(i).map(|(n, _)| Arc::from(n)),
        }
    }

    /// Adds a field to the dynamic table, evicting the oldest to make room; one larger than the
    /// whole table empties it (RFC 7541 §4.4).
    fn insert(&mut self, name: &[u8], value: &[u8]) {
        self.insert_named(Arc::from(name), value);
    }

    /// [`insert`](Self::insert) of a name held already.
    fn insert_named(&mut self, name: Arc<[u8]>, value: &[u8]) {
        let size = name.len() + value.len() + FIELD_OVERHEAD;
        if size > self.max_size {
            self.insert_too_large();
            return;
        }
        self.evict(size);
        self.table.push_front((name, value.to_vec()));
        self.size += size;
    }

    /// What adding an entry larger than the whole table does: empties it.
    fn insert_too_large(&mut self) {
        self.table.clear();
        self.size = 0;
    }

    /// Evicts the oldest entries until `room` more bytes fit.
    fn evict(&mut self, room: usize) {
        while self.size + room > self.max_size {
            let Some((n, v)) = self.table.pop_back() else { break };
            self.size -= n.len() + v.len() + FIELD_OVERHEAD;
        }
    }
}

/// What [`Decoder::decode`] made of a block.
pub(crate) enum Outcome {
    /// The whole list, each field handed on.
    Within,
    /// The list passed the bound; the fields before it were handed on. The block's rest may
    /// still come ([`Overflow::feed`]); [`Overflow::finish`] gives the list's size.
    Over(Overflow),
}

/// Where decoding stood when a field began.
#[derive(Default)]
struct Progress {
    start: usize,
    list: usize,
    fields_seen: bool,
}

/// Follows a header block whose list is too large to pass on, in pieces as they come: the
/// dynamic table keeps the client's entries and the list is counted, but no more of the block is
/// held than a field the table could take (a string too long for the table is counted as it
/// goes by, never held). A connection carrying such a block can then go on, and only its call
/// is refused.
#[derive(Default)]
pub(crate) struct Overflow {
    /// The bytes of a field not yet whole.
    held: Vec<u8>,
    /// Where in its field the next bytes are.
    step: Step,
    /// Bytes of a long string still to go by, and the length it decodes to so far.
    skip: usize,
    skipped: Skipped,
    /// The list's size so far, counted as HTTP/2 does.
    list: usize,
    fields_seen: bool,
}

#[derive(Default)]
enum Step {
    /// At a field's first byte.
    #[default]
    Start,
    /// At a new name's string.
    Name { indexing: bool },
    /// At the value's string; the name, unless it was too long to hold, and its length.
    Value { indexing: bool, name: Option<Arc<[u8]>>, name_len: usize },
}

/// A long string going by: its decoded length so far, and, if it is Huffman-coded, where its
/// code stands.
#[derive(Default)]
struct Skipped {
    huffman: Option<Huffman>,
    len: usize,
}

impl Skipped {
    /// Counts the octets of the next bytes, refusing what [`huffman_decode`] refuses.
    fn count(&mut self, bytes: &[u8]) -> Result<(), Error> {
        let Some(code) = &mut self.huffman else {
            self.len += bytes.len();
            return Ok(());
        };
        for &byte in bytes {
            for shift in (0..8).rev() {
                if code.bit((byte >> shift) & 1)?.is_some() {
                    self.len += 1;
                }
            }
        }
        Ok(())
    }

    /// The string has ended: its length, decoded.
    fn end(&self) -> Result<usize, Error> {
        self.huffman.as_ref().map_or(Ok(()), Huffman::end)?;
        Ok(self.len)
    }
}

impl Overflow {
    /// The next piece of the block. `field` gets each field held whole (a long string's field
    /// is not); nothing is copied for a field that is not.
    pub(crate) fn feed(
        &mut self,
        d: &mut Decoder,
        bytes: &[u8],
        mut field: impl FnMut(&[u8], &[u8]),
    ) -> Result<(), Error> {
        // A piece that starts at a field is read where it lies; only a field cut between
        // pieces is put together, in `held`, which never holds more than one (so a piece added
        // to it costs what it brings, however many pieces a long field comes in).
        // After an error the connection ends: what is held then does not matter.
        if self.held.is_empty() {
            let at = self.take(d, bytes, &mut field)?;
            self.held.extend_from_slice(&bytes[at..]);
        } else {
            let mut held = std::mem::take(&mut self.held);
            held.extend_from_slice(bytes);
            let at = self.take(d, &held, &mut field)?;
            held.drain(..at);
            self.held = held;
        }
        Ok(())
    }

    /// Takes every whole item at the start of `buf`, and the part of a long string it holds;
    /// the bytes taken.
    fn take(&mut self, d: &mut Decoder, buf: &[u8], field: &mut impl FnMut(&[u8], &[u8])) -> Result<usize, Error> {
        let mut at = 0;
        loop {
            if self.skip > 0 {
                let n = self.skip.min(buf.len() - at);
                self.skipped.count(&buf[at..at + n])?;
                at += n;
                self.skip -= n;
                if self.skip > 0 {
                    return Ok(at);
                }
                let len = self.skipped.end()?;
                self.string_done(d, None, len, field);
                continue;
            }
            match self.next(d, &buf[at..], field)? {
                Some(n) => at += n,
                None => return Ok(at),
            }
        }
    }

    /// The list's size, once the block has ended; an error if it ended inside a field.
    pub(crate) fn finish(&self) -> Result<usize, Error> {
        match (&self.step, self.skip, self.held.is_empty()) {
            (Step::Start, 0, true) => Ok(self.list),
            _ => Err(Error::Truncated),
        }
    }

    /// Takes the next whole item at the start of `buf`: a field's head or one of its strings.
    /// The bytes taken, or None if more must come first.
    fn next(
        &mut self,
        d: &mut Decoder,
        buf: &[u8],
        field: &mut impl FnMut(&[u8], &[u8]),
    ) -> Result<Option<usize>, Error> {
        let Some(&first) = buf.first() else { return Ok(None) };
        let Some((v, n)) = whole(integer(buf, prefix_of(&self.step, first)))? else { return Ok(None) };
        match std::mem::take(&mut self.step) {
            Step::Start if first & 0x80 != 0 => {
                let (name, value) = d.entry(v)?;
                self.list = self.list.saturating_add(name.len() + value.len() + FIELD_OVERHEAD);
                self.fields_seen = true;
                field(name, value);
            }
            Step::Start if first & 0xe0 == 0x20 => d.size_update(v, self.fields_seen)?,
            Step::Start => {
                let indexing = first & 0x40 != 0;
                self.step = if v == 0 {
                    Step::Name { indexing }
                } else {
                    let name = d.entry_name(v)?;
                    Step::Value { indexing, name_len: name.len(), name: Some(name) }
                };
            }
            step => {
                // A string: `v` bytes after its length.
                self.step = step;
                if v > d.long_string() {
                    self.skip = v;
                    self.skipped = Skipped { huffman: (first & 0x80 != 0).then(Huffman::default), len: 0 };
                    return Ok(Some(n));
                }
                let Some(raw) = buf.get(n..n + v) else { return Ok(None) };
                let mut s = Vec::new();
                if first & 0x80 != 0 {
                    huffman_decode(raw, &mut s, usize::MAX)?;
                } else {
                    s.extend_from_slice(raw);
                }
                let len = s.len();
                self.string_done(d, Some(s), len, field);
                return Ok(Some(n + v));
            }
        }
        Ok(Some(n))
    }

    /// A name or value string has been read (`s`, or None if it was too long to hold).
    fn string_done(&mut self, d: &mut Decoder, s: Option<Vec<u8>>, len: usize, field: &mut impl FnMut(&[u8], &[u8])) {
        match std::mem::take(&mut self.step) {
            Step::Name { indexing } => {
                self.step = Step::Value { indexing, name: s.map(Arc::from), name_len: len };
            }
            Step::Value { indexing, name, name_len } => {
                self.list = self.list.saturating_add(name_len).saturating_add(len).saturating_add(FIELD_OVERHEAD);
                self.fields_seen = true;
                match (name, s) {
                    (Some(name), Some(value)) => {
                        field(&name, &value);
                        if indexing {
                            d.insert_named(name, &value);
                        }
                    }
                    // Larger than the whole table: indexing it empties the table (RFC 7541 §4.4).
                    _ if indexing => d.insert_too_large(),
                    _ => {}
                }
            }
            Step::Start => {}
        }
    }
}

/// The prefix bits of the integer that starts an item at `step` whose first byte is `first`.
fn prefix_of(step: &Step, first: u8) -> u32 {
    match step {
        Step::Start if first & 0x80 != 0 => 7,
        Step::Start if first & 0xe0 == 0x20 => 5,
        Step::Start => literal_prefix(first & 0x40 != 0),
        // A string's length.
        _ => 7,
    }
}

/// The prefix of a literal's name index: 6 bits with incremental indexing, else 4.
fn literal_prefix(indexing: bool) -> u32 {
    if indexing {
        6
    } else {
        4
    }
}

/// An integer that may not all have come yet: None then.
fn whole(r: Result<(usize, usize), Error>) -> Result<Option<(usize, usize)>, Error> {
    match r {
        Ok(v) => Ok(Some(v)),
        Err(Error::Truncated) => Ok(None),
        Err(e) => Err(e),
    }
}

/// `list` with a field of `strings` bytes added, unless that passes `bound`.
fn within(list: usize, strings: usize, bound: usize) -> Result<usize, Error> {
    let list = list.saturating_add(strings).saturating_add(FIELD_OVERHEAD);
    if list > bound {
        return Err(Error::TooLarge);
    }
    Ok(list)
}

/// An integer with an `n`-bit prefix (RFC 7541 §5.1), and the bytes it took. At most five
/// continuation bytes, as h2 takes.
fn integer(buf: &[u8], n: u32) -> Result<(usize, usize), Error> {
    let mask = (1u8 << n) - 1;
    let first = buf.first().ok_or(Error::Truncated)? & mask;
    if first < mask {
        return Ok((usize::from(first), 1));
    }
    let mut value = usize::from(mask);
    for (i, &b) in buf[1..].iter().enumerate().take(5) {
        value += usize::from(b & 0x7f) << (7 * i);
        if b & 0x80 == 0 {
            return Ok((value, i + 2));
        }
    }
    if buf.len() <= 6 {
        Err(Error::Truncated)
    } else {
        Err(Error::Integer)
    }
}

/// A string literal (RFC 7541 §5.2) appended to `out` if it decodes to at most `limit` bytes;
/// the bytes it took.
fn string(buf: &[u8], out: &mut Vec<u8>, limit: usize) -> Result<usize, Error> {
    let huffman = buf.first().ok_or(Error::Truncated)? & 0x80 != 0;
    let (len, n) = integer(buf, 7)?;
    let raw = buf.get(n..).and_then(|rest| rest.get(..len)).ok_or(Error::Truncated)?;
    if huffman {
        huffman_decode(raw, out, limit)?;
    } else if raw.len() > limit {
        return Err(Error::TooLarge);
    } else {
        out.extend_from_slice(raw);
    }
    Ok(n + len)
}

/// Decodes the Huffman code of RFC 7541 Appendix B, appending at most `limit` bytes to `out`.
fn huffman_decode(src: &[u8], out: &mut Vec<u8>, limit: usize) -> Result<(), Error> {
    let start = out.len();
    let mut code = Huffman::default();
    for &byte in src {
        for shift in (0..8).rev() {
            if let Some(byte) = code.bit((byte >> shift) & 1)? {
                if out.len() - start >= limit {
                    return Err(Error::TooLarge);
                }
                out.push(byte);
            }
        }
    }
    code.end()
}

/// Where a Huffman-coded string stands between two bits: the bits of a code not yet whole.
#[derive(Default)]
struct Huffman {
    code: u32,
    len: usize,
}

impl Huffman {
    /// Takes the next bit; the octet it completes, if any.
    #[inline]
    fn bit(&mut self, bit: u8) -> Result<Option<u8>, Error> {
        self.code = (self.code << 1) | u32::from(bit);
        self.len += 1;
        // A canonical code: the `len`-bit codes are `first[len]` onwards, consecutive, and a
        // longer code's first `len` bits are past them. Every 30-bit pattern starts a code.
        let i = self.code.wrapping_sub(CANONICAL.first[self.len]);
        if i < u32::from(CANONICAL.count[self.len]) {
            let symbol = CANONICAL.symbols[usize::from(CANONICAL.offset[self.len]) + i as usize];
            *self = Huffman::default();
            return u8::try_from(symbol).map(Some).map_err(|_| Error::Huffman); // 256 is EOS
        }
        if self.len == MAX_CODE {
            return Err(Error::Huffman);
        }
        Ok(None)
    }

    /// The string has ended. Padding: fewer than 8 bits, the first bits of EOS (all ones).
    fn end(&self) -> Result<(), Error> {
        if self.len > 7 || self.code != (1u32 << self.len) - 1 {
            return Err(Error::Huffman);
        }
        Ok(())
    }
}

/// The longest code (EOS's).
const MAX_CODE: usize = 30;

/// The code's length for each of the 257 symbols (the 256 octets, then EOS), from RFC 7541
/// Appendix B. The code is canonical: codes of one length are consecutive, in the order of
/// their symbols, each length's first code following the last shorter one; the lengths are all
/// it takes to rebuild it (a test checks the RFC's examples).
const LENGTHS: [u8; 257] = [
    13, 23, 28, 28, 28, 28, 28, 28, 28, 24, 30, 28, 28, 30, 28, 28, //
    28, 28, 28, 28, 28, 28, 30, 28, 28, 28, 28, 28, 28, 28, 28, 28, //
    6, 10, 10, 12, 13, 6, 8, 11, 10, 10, 8, 11, 8, 6, 6, 6, //
    5, 5, 5, 6, 6, 6, 6, 6, 6, 6, 7, 8, 15, 6, 12, 10, //
    13, 6, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, //
    7, 7, 7, 7, 7, 7, 7, 7, 8, 7, 8, 13, 19, 13, 14, 6, //
    15, 5, 6, 5, 6, 5, 6, 6, 6, 5, 7, 7, 6, 6, 6, 5, //
    6, 7, 6, 5, 5, 6, 7, 7, 7, 7, 7, 15, 11, 14, 13, 28, //
    20, 22, 20, 20, 22, 22, 22, 23, 22, 23, 23, 23, 23, 23, 24, 23, //
    24, 24, 22, 23, 24, 23, 23, 23, 23, 21, 22, 23, 22, 23, 23, 24, //
    22, 21, 20, 22, 22, 23, 23, 21, 23, 22, 22, 24, 21, 22, 23, 23, //
    21, 21, 22, 21, 23, 22, 23, 23, 20, 22, 22, 22, 23, 22, 22, 23, //
    26, 26, 20, 19, 22, 23, 22, 25, 26, 26, 26, 27, 27, 26, 24, 25, //
    19, 21, 26, 27, 27, 26, 27, 24, 21, 21, 26, 26, 28, 27, 27, 27, //
    20, 24, 20, 21, 22, 21, 21, 23, 22, 22, 25, 25, 24, 24, 26, 23, //
    26, 27, 26, 26, 27, 27, 27, 27, 27, 28, 27, 27, 27, 27, 27, 26, //
    30,
];

/// The canonical form of the code, per code length.
struct Canonical {
    /// The first code of each length.
    first: [u32; MAX_CODE + 1],
    /// How many codes have each length.
    count: [u16; MAX_CODE + 1],
    /// Where each length's symbols start in `symbols`.
    offset: [u16; MAX_CODE + 1],
    /// The symbols by code length, then symbol.
    symbols: [u16; 257],
}

const CANONICAL: Canonical = canonical();

const fn canonical() -> Canonical {
    let mut c =
        Canonical { first: [0; MAX_CODE + 1], count: [0; MAX_CODE + 1], offset: [0; MAX_CODE + 1], symbols: [0; 257] };
    let mut code = 0u32;
    let mut at = 0usize;
    let mut len = 1;
    while len <= MAX_CODE {
        c.first[len] = code;
        c.offset[len] = at as u16;
        let mut symbol = 0;
        while symbol < 257 {
            if LENGTHS[symbol] as usize == len {
                c.symbols[at] = symbol as u16;
                at += 1;
                c.count[len] += 1;
                code += 1;
            }
            symbol += 1;
        }
        code <<= 1;
        len += 1;
    }
    c
}

/// The static table (RFC 7541 Appendix A), indices 1 to 61.
const STATIC: [(&str, &str); 61] = [
    (":authority", ""),
    (":method", "GET"),
    (":method", "POST"),
    (":path", "/"),
    (":path", "/index.html"),
    (":scheme", "http"),
    (":scheme", "https"),
    (":status", "200"),
    (":status", "204"),
    (":status", "206"),
    (":status", "304"),
    (":status", "400"),
    (":status", "404"),
    (":status", "500"),
    ("accept-charset", ""),
    ("accept-encoding", "gzip, deflate"),
    ("accept-language", ""),
    ("accept-ranges", ""),
    ("accept", ""),
    ("access-control-allow-origin", ""),
    ("age", ""),
    ("allow", ""),
    ("authorization", ""),
    ("cache-control", ""),
    ("content-disposition", ""),
    ("content-encoding", ""),
    ("content-language", ""),
    ("content-length", ""),
    ("content-location", ""),
    ("content-range", ""),
    ("content-type", ""),
    ("cookie", ""),
    ("date", ""),
    ("etag", ""),
    ("expect", ""),
    ("expires", ""),
    ("from", ""),
    ("host", ""),
    ("if-match", ""),
    ("if-modified-since", ""),
    ("if-none-match", ""),
    ("if-range", ""),
    ("if-unmodified-since", ""),
    ("last-modified", ""),
    ("link", ""),
    ("location", ""),
    ("max-forwards", ""),
    ("proxy-authenticate", ""),
    ("proxy-authorization", ""),
    ("range", ""),
    ("referer", ""),
    ("refresh", ""),
    ("retry-after", ""),
    ("server", ""),
    ("set-cookie", ""),
    ("strict-transport-security", ""),
    ("transfer-encoding", ""),
    ("user-agent", ""),
    ("vary", ""),
    ("via", ""),
    ("www-authenticate", ""),
];

#[cfg(test)]
mod tests {
    use super::*;

    fn hex(s: &str) -> Vec<u8> {
        let s: String = s.chars().filter(|c| !c.is_whitespace()).collect();
        (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).expect("hex")).collect()
    }

    fn fields(d: &mut Decoder, block: &[u8]) -> Result<Vec<(String, String)>, Error> {
        let mut out = Vec::new();
        d.decode(block, 1 << 20, |n, v| {
            out.push((String::from_utf8_lossy(n).into_owned(), String::from_utf8_lossy(v).into_owned()))
        })?;
        Ok(out)
    }

    fn pairs(list: &[(&str, &str)]) -> Vec<(String, String)> {
        list.iter().map(|(n, v)| ((*n).to_owned(), (*v).to_owned())).collect()
    }

    #[test]
    fn the_canonical_code_is_the_rfcs() {
        // RFC 7541 Appendix B: '0' is 00000 (5 bits), 'a' 00011, '&' 11111000 (8), EOS 30 ones.
        let code_of = |symbol: usize| {
            let len = usize::from(LENGTHS[symbol]);
            let (start, count) = (usize::from(CANONICAL.offset[len]), usize::from(CANONICAL.count[len]));
            let at = (start..start + count).find(|&at| usize::from(CANONICAL.symbols[at]) == symbol);
            CANONICAL.first[len] + (at.expect("the symbol") - start) as u32
        };
        assert_eq!(code_of(usize::from(b'0')), 0b00000);
        assert_eq!(code_of(usize::from(b'a')), 0b00011);
        assert_eq!(code_of(usize::from(b'&')), 0b1111_1000);
        assert_eq!(code_of(256), 0x3fff_ffff);
        assert_eq!(CANONICAL.count.iter().map(|&c| usize::from(c)).sum::<usize>(), 257);
    }

    #[test]
    fn the_rfcs_huffman_examples_decode() {
        // RFC 7541 C.4.1-C.4.3 and C.6.1.
        for (code, text) in [
            ("f1e3 c2e5 f23a 6ba0 ab90 f4ff", "www.example.com"),
            ("a8eb 1064 9cbf", "no-cache"),
            ("25a8 49e9 5ba9 7d7f", "custom-key"),
            ("25a8 49e9 5bb8 e8b4 bf", "custom-value"),
            ("6402", "302"),
            ("aec3 771a 4b", "private"),
            ("d07a be94 1054 d444 a820 0595 040b 8166 e082 a62d 1bff", "Mon, 21 Oct 2013 20:13:21 GMT"),
            ("9d29 ad17 1863 c78f 0b97 c8e9 ae82 ae43 d3", "https://www.example.com"),
        ] {
            let mut out = Vec::new();
            huffman_decode(&hex(code), &mut out, usize::MAX).expect(text);
            assert_eq!(out, text.as_bytes());
        }
    }

    #[test]
    fn bad_huffman_is_refused() {
        let mut out = Vec::new();
        // EOS inside a string; padding of 8 bits; padding that is not all ones ('0' then 000).
        assert_eq!(huffman_decode(&[0xff, 0xff, 0xff, 0xff], &mut out, 64), Err(Error::Huffman));
        assert_eq!(huffman_decode(&[0x07, 0xff], &mut out, 64), Err(Error::Huffman)); // '0', then 11 ones
        assert_eq!(huffman_decode(&[0x00], &mut out, 64), Err(Error::Huffman));
        // A limit is a limit: "www.example.com" is 15 bytes.
        assert_eq!(huffman_decode(&hex("f1e3 c2e5 f23a 6ba0 ab90 f4ff"), &mut out, 14), Err(Error::TooLarge));
    }

    #[test]
    fn the_rfcs_request_examples_decode_with_their_dynamic_table() {
        // RFC 7541 C.4: three requests with Huffman coding on one connection.
        let mut d = Decoder::new(4096);
        let first = fields(&mut d, &hex("8286 8441 8cf1 e3c2 e5f2 3a6b a0ab 90f4 ff")).expect("C.4.1");
        assert_eq!(
            first,
            pairs(&[(":method", "GET"), (":scheme", "http"), (":path", "/"), (":authority", "www.example.com")])
        );
        let second = fields(&mut d, &hex("8286 84be 5886 a8eb 1064 9cbf")).expect("C.4.2");
        assert_eq!(
            second,
            pairs(&[
                (":method", "GET"),
                (":scheme", "http"),
                (":path", "/"),
                (":authority", "www.example.com"),
                ("cache-control", "no-cache"),
            ])
        );
        let third = fields(&mut d, &hex("8287 85bf 4088 25a8 49e9 5ba9 7d7f 8925 a849 e95b b8e8 b4bf")).expect("C.4.3");
        assert_eq!(
            third,
            pairs(&[
                (":method", "GET"),
                (":scheme", "https"),
                (":path", "/index.html"),
                (":authority", "www.example.com"),
                ("custom-key", "custom-value"),
            ])
        );
        assert_eq!(d.size, 164);
    }

    #[test]
    fn a_small_table_evicts_as_the_rfc_says() {
        // RFC 7541 C.5 (responses, no Huffman) with a 256-byte table: the second response evicts
        // the first entry, the third leaves three of its own.
        let mut d = Decoder::new(256);
        let blocks = [
            "4803 3330 3258 0770 7269 7661 7465 611d 4d6f 6e2c 2032 3120 4f63 7420 3230 3133 2032 303a \
             3133 3a32 3120 474d 546e 1768 7474 7073 3a2f 2f77 7777 2e65 7861 6d70 6c65 2e63 6f6d",
            "4803 3330 37c1 c0bf",
            "88c1 611d 4d6f 6e2c 2032 3120 4f63 7420 3230 3133 2032 303a 3133 3a32 3220 474d 54c0 5a04 \
             677a 6970 7738 666f 6f3d 4153 444a 4b48 514b 425a 584f 5157 454f 5049 5541 5851 5745 4f49 \
             553b 206d 6178 2d61 6765 3d33 3630 303b 2076 6572 7369 6f6e 3d31",
        ];
        for block in blocks {
            fields(&mut d, &hex(block)).expect("C.5");
        }
        assert_eq!(d.size, 215);
        assert_eq!(d.table.len(), 3);
        assert_eq!(&d.table[0].0[..], b"set-cookie");
        assert_eq!(d.table[2].1, b"Mon, 21 Oct 2013 20:13:22 GMT");
    }

    #[test]
    fn the_bound_stops_decoding_before_what_passes_it_is_copied() {
        // A field indexed into the table once, then named 10,000 times: 10 KB that decode to far
        // more than a 64 KiB bound. Decoding stops at the field that passes it.
        let mut block = vec![0x40, 0x01, b'k', 0x7f, 0xe9, 0x06]; // literal, new name "k", value of 1000
        block.extend(std::iter::repeat_n(b'v', 1000));
        block.extend(std::iter::repeat_n(0xbe, 10_000)); // index 62
        let mut d = Decoder::new(4096);
        let mut seen = 0;
        let Ok(Outcome::Over(over)) = d.decode(&block, 64 << 10, |_, _| seen += 1) else { panic!("over") };
        assert_eq!(seen, (64 << 10) / (1 + 1000 + FIELD_OVERHEAD));
        // The rest is counted, not handed on.
        assert_eq!(over.finish(), Ok(10_001 * (1 + 1000 + FIELD_OVERHEAD)));
        // A Huffman string past the bound is not inflated: counted as it goes by.
        let mut d = Decoder::new(4096);
        let mut block = vec![0x00, 0x01, b'k', 0xff, 0xff, 0x7f]; // a 16,510-byte Huffman value
        block.extend(std::iter::repeat_n(0x00, 16_510)); // '0' '0' '0'... (5 bits each)
        let Ok(Outcome::Over(over)) = d.decode(&block, 1 << 10, |_, _| ()) else { panic!("over") };
        assert_eq!(over.finish(), Ok(1 + 16_510 * 8 / 5 + FIELD_OVERHEAD));
    }

    /// A block of every kind of representation: a size update, indexed fields, literals with
    /// and without indexing, new and indexed names, Huffman strings, and two strings too long
    /// for the table, one of them indexed (which empties the table).
    fn every_kind() -> Vec<u8> {
        let mut block = vec![0x3f, 0xe1, 0x1f]; // table size 4096
        block.extend(hex("8286 8441 8cf1 e3c2 e5f2 3a6b a0ab 90f4 ff")); // RFC C.4.1
        block.extend(hex("5886 a8eb 1064 9cbf")); // cache-control: no-cache, indexed
        block.extend(hex("4088 25a8 49e9 5ba9 7d7f 8925 a849 e95b b8e8 b4bf")); // custom-key, indexed
        block.push(0x40); // a long value, indexed: the table empties
        block.extend([0x01, b'x', 0x7f, 0x81, 0xa0, 0x01]); // 20,608 bytes
        block.extend(std::iter::repeat_n(b'v', 20_608));
        block.extend([0x00, 0x02, b'y', b'z', 0x7f, 0x81, 0xa0, 0x01]); // one not indexed
        block.extend(std::iter::repeat_n(b'w', 20_608));
        block.extend([0x40, 0x01, b'k', 0x03, b'a', b'b', b'c']); // k: abc, indexed
        block.extend([0x44, 0x02, b'/', b'1']); // :path from the static table's name, "/1", indexed
        block.push(0xbe); // index 62: the newest, :path /1
        block
    }

    #[test]
    fn a_block_followed_in_pieces_leaves_the_table_a_whole_decode_leaves() {
        let block = every_kind();
        let mut whole = Decoder::new(4096);
        let mut expected = Vec::new();
        let outcome = whole.decode(&block, usize::MAX, |n, v| {
            if v.len() < 20_000 {
                expected.push((n.to_vec(), v.to_vec()));
            }
        });
        assert!(matches!(outcome, Ok(Outcome::Within)));
        let list: usize = (FIELD_OVERHEAD * 11)
            + [":method", "GET", ":scheme", "http", ":path", "/", ":authority", "www.example.com"]
                .iter()
                .map(|s| s.len())
                .sum::<usize>()
            + "cache-controlno-cache".len()
            + "custom-keycustom-value".len()
            + 1
            + 20_608
            + 2
            + 20_608
            + "kabc".len()
            + 2 * ":path/1".len();
        for step in [1, 2, 3, 7, 100, 5000, block.len()] {
            let mut d = Decoder::new(4096);
            let mut over = Overflow::default();
            let mut got = Vec::new();
            for piece in block.chunks(step) {
                over.feed(&mut d, piece, |n, v| got.push((n.to_vec(), v.to_vec()))).expect("decodes");
            }
            assert_eq!(over.finish(), Ok(list), "step {step}");
            assert_eq!(got, expected, "step {step}");
            assert_eq!((d.size, &d.table), (whole.size, &whole.table), "step {step}");
            // Only what the long indexed value left: k, then :path.
            assert_eq!(d.table.len(), 2);
            // The table is the client's: the next block names its entries.
            let mut next = Vec::new();
            d.decode(&[0xbf, 0xbe], usize::MAX, |n, v| next.push((n.to_vec(), v.to_vec()))).expect("next");
            assert_eq!(next, [(b"k".to_vec(), b"abc".to_vec()), (b":path".to_vec(), b"/1".to_vec())]);
        }
        // Past a bound, the decoder hands on the fields before it and follows the rest.
        let mut d = Decoder::new(4096);
        let mut before = 0;
        let Ok(Outcome::Over(over)) = d.decode(&block, 10_000, |_, _| before += 1) else { panic!("over") };
        assert_eq!(before, 6);
        assert_eq!(over.finish(), Ok(list));
        assert_eq!((d.size, &d.table), (whole.size, &whole.table));
    }

    #[test]
    fn a_name_named_again_is_shared_not_copied() {
        // A 4,000-byte name into the table, then indexed again 100,000 times by its index with
        // an empty value (two bytes each): each new entry evicts the last, and shares its name.
        let mut d = Decoder::new(4096);
        let mut over = Overflow::default();
        let mut head = vec![0x40, 0x7f, 0xa1, 0x1e]; // literal, indexed, new name of 4,000 bytes
        head.extend(std::iter::repeat_n(b'n', 4000));
        head.push(0x00);
        over.feed(&mut d, &head, |_, _| ()).expect("head");
        let first = d.table[0].0.clone();
        let again: Vec<u8> = std::iter::repeat_n([0x7e, 0x00], 100_000).flatten().collect();
        over.feed(&mut d, &again, |_, _| ()).expect("again");
        assert_eq!(over.finish(), Ok(100_001 * (4000 + FIELD_OVERHEAD)));
        assert_eq!(d.table.len(), 1);
        assert!(Arc::ptr_eq(&first, &d.table[0].0), "the name was copied");
    }

    #[test]
    fn a_long_string_that_goes_by_is_still_checked() {
        // Huffman: EOS inside, or padding that is not EOS's first bits, as huffman_decode says.
        let long = |fill: u8, last: &[u8]| {
            let mut block = vec![0x00, 0x01, b'k', 0xff, 0xff, 0x7f]; // a 16,510-byte Huffman value
            block.extend(std::iter::repeat_n(fill, 16_510 - last.len()));
            block.extend_from_slice(last);
            block
        };
        for (block, want) in [
            (long(0x00, &[0x1f]), Ok(())),              // '0's, then '0' and 111 padding
            (long(0x00, &[0x18]), Err(Error::Huffman)), // '0', then padding 11000
            (long(0x00, &[0xff, 0xff, 0xff, 0xff]), Err(Error::Huffman)), // EOS
        ] {
            let mut over = Overflow::default();
            let fed = over.feed(&mut Decoder::new(4096), &block, |_, _| ());
            assert_eq!(fed.and_then(|()| over.finish().map(|_| ())), want);
        }
    }

    #[test]
    fn an_overflow_that_ends_inside_a_field_or_holds_bad_input_is_an_error() {
        let block = every_kind();
        for cut in [1, 21, 40, 100, 30_000, block.len() - 2] {
            let mut over = Overflow::default();
            over.feed(&mut Decoder::new(4096), &block[..cut], |_, _| ()).expect("a piece");
            assert_eq!(over.finish(), Err(Error::Truncated), "cut at {cut}");
        }
        let mut over = Overflow::default();
        assert_eq!(over.feed(&mut Decoder::new(4096), &[0x82, 0xbe], |_, _| ()), Err(Error::Index(62)));
        let mut over = Overflow::default();
        assert_eq!(over.feed(&mut Decoder::new(4096), &[0x82, 0x20], |_, _| ()), Err(Error::TableSize(0)));
        let mut over = Overflow::default();
        assert_eq!(over.feed(&mut Decoder::new(4096), &[0x00, 0x81, 0x00, 0x00], |_, _| ()), Err(Error::Huffman));
        // What it holds at most: a field the table could take, not a long string.
        let mut over = Overflow::default();
        let mut d = Decoder::new(4096);
        over.feed(&mut d, &[0x00, 0x01, b'x', 0x7f, 0x81, 0xa0, 0x01], |_, _| ()).expect("head");
        for _ in 0..100 {
            over.feed(&mut d, &[b'v'; 200], |_, _| ()).expect("a piece");
            assert!(over.held.is_empty());
        }
    }

    #[test]
    fn malformed_blocks_are_errors() {
        let mut d = Decoder::new(4096);
        assert_eq!(d.decode(&[0x80], 1 << 20, |_, _| ()).err(), Some(Error::Index(0)));
        assert_eq!(d.decode(&[0xbe], 1 << 20, |_, _| ()).err(), Some(Error::Index(62)));
        assert_eq!(d.decode(&[0xff], 1 << 20, |_, _| ()).err(), Some(Error::Truncated));
        assert_eq!(
            d.decode(&[0xff, 0x80, 0x80, 0x80, 0x80, 0x80, 0x01], 1 << 20, |_, _| ()).err(),
            Some(Error::Integer)
        );
        assert_eq!(d.decode(&[0x00, 0x05, b'a'], 1 << 20, |_, _| ()).err(), Some(Error::Truncated));
        assert_eq!(d.decode(&[0x3f, 0xe2, 0x1f], 1 << 20, |_, _| ()).err(), Some(Error::TableSize(4097)));
        assert_eq!(d.decode(&[0x82, 0x20], 1 << 20, |_, _| ()).err(), Some(Error::TableSize(0)));
        // Updates before the first field are fine, and a table of 0 holds nothing.
        let mut d = Decoder::new(4096);
        assert_eq!(fields(&mut d, &[0x20, 0x3f, 0x01, 0x40, 0x01, b'a', 0x01, b'b']), Ok(pairs(&[("a", "b")])));
        assert_eq!(d.table.len(), 0);
    }
}
