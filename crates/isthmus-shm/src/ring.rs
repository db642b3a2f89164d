//! Single-producer single-consumer rings in the segment: the frame ring and the release ring.
//!
//! Cursors are monotonic u64 counts (bytes for frames, entries for releases); a position is the
//! cursor modulo the capacity. Each side keeps its own cursor in private memory and only
//! *publishes* it to the segment, so a peer scribbling on our cursor changes nothing we rely on.
//! The peer's cursor is read, then checked against ours and the capacity, before any use.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use bytes::Bytes;

use crate::error::{Error, ErrorKind, Result};
use crate::frame::{frame_footprint, FrameHeader};
use crate::layout::{self, FRAME_HEADER_LEN, RELEASE_ENTRY_LEN};
use crate::segment::{Region, Segment};

/// The writing end of direction `dir`'s frame ring.
#[derive(Debug)]
pub(crate) struct FrameProducer {
    seg: Arc<Segment>,
    dir: usize,
    data: Region,
    tail: u64,
    head_seen: u64,
}

impl FrameProducer {
    pub(crate) fn new(seg: Arc<Segment>, dir: usize) -> FrameProducer {
        let l = *seg.layout();
        let data = seg.region(l.ring_off[dir], l.ring_size[dir]);
        FrameProducer { seg, dir, data, tail: 0, head_seen: 0 }
    }

    /// Largest body a frame in this ring can carry.
    pub(crate) fn max_body(&self) -> usize {
        self.data.len() - FRAME_HEADER_LEN
    }

    /// Free bytes, refreshing the consumer's head from the segment if `need` does not fit the
    /// last value seen.
    fn free(&mut self, need: usize) -> Result<usize> {
        let cap = self.data.len() as u64;
        let mut used = self.tail - self.head_seen;
        if cap - used < need as u64 {
            let head = self.seg.ctl_u64(self.dir, layout::CTL_HEAD).load(Ordering::Acquire);
            if head > self.tail || head < self.head_seen || self.tail - head > cap {
                return Err(Error::protocol(format!(
                    "frame ring corrupted: consumer head {head} is out of range (tail {}, capacity {cap})",
                    self.tail
                )));
            }
            self.head_seen = head;
            used = self.tail - head;
        }
        Ok((cap - used) as usize)
    }

    /// True if a frame with a `body_len`-byte body fits now.
    pub(crate) fn has_room(&mut self, body_len: usize) -> Result<bool> {
        let need = frame_footprint(body_len);
        Ok(self.free(need)? >= need)
    }

    /// Appends one frame whose body is the concatenation of `body`; false if the ring is full.
    pub(crate) fn try_push(&mut self, header: &FrameHeader, body: &[&[u8]]) -> Result<bool> {
        let body_len: usize = body.iter().map(|b| b.len()).sum();
        debug_assert_eq!(header.len as usize, body_len);
        if body_len > self.max_body() {
            return Err(Error::new(
                ErrorKind::TooLarge,
                format!("a {body_len}-byte frame body does not fit a {}-byte ring", self.data.len()),
            ));
        }
        let need = frame_footprint(body_len);
        if self.free(need)? < need {
            return Ok(false);
        }
        let mask = self.data.len() - 1;
        let mut at = self.tail as usize & mask;
        self.data.write_wrapping(at, &header.encode());
        at = (at + FRAME_HEADER_LEN) & mask;
        for part in body {
            if !part.is_empty() {
                self.data.write_wrapping(at, part);
                at = (at + part.len()) & mask;
            }
        }
        self.tail += need as u64;
        self.seg.ctl_u64(self.dir, layout::CTL_TAIL).store(self.tail, Ordering::Release);
        Ok(true)
    }
}

/// A frame as read from the ring: its header and its body, copied into private memory.
#[derive(Debug)]
pub(crate) struct RawFrame {
    pub(crate) header: FrameHeader,
    pub(crate) body: Bytes,
}

/// The reading end of direction `dir`'s frame ring.
#[derive(Debug)]
pub(crate) struct FrameConsumer {
    seg: Arc<Segment>,
    dir: usize,
    data: Region,
    head: u64,
}

impl FrameConsumer {
    pub(crate) fn new(seg: Arc<Segment>, dir: usize) -> FrameConsumer {
        let l = *seg.layout();
        let data = seg.region(l.ring_off[dir], l.ring_size[dir]);
        FrameConsumer { seg, dir, data, head: 0 }
    }

    /// Bytes published by the producer and not yet consumed, validated against the capacity.
    fn available(&self) -> Result<u64> {
        let tail = self.seg.ctl_u64(self.dir, layout::CTL_TAIL).load(Ordering::Acquire);
        let avail = tail.wrapping_sub(self.head);
        if avail > self.data.len() as u64 {
            return Err(Error::protocol(format!(
                "frame ring corrupted: producer tail {tail} is out of range (head {}, capacity {})",
                self.head,
                self.data.len()
            )));
        }
        Ok(avail)
    }

    /// True if at least one frame is waiting.
    pub(crate) fn is_ready(&self) -> Result<bool> {
        Ok(self.available()? > 0)
    }

    /// Takes the next frame, if any. Every length is checked against what the producer published
    /// before a byte of body is copied.
    pub(crate) fn try_pop(&mut self) -> Result<Option<RawFrame>> {
        let avail = self.available()?;
        if avail == 0 {
            return Ok(None);
        }
        if avail < FRAME_HEADER_LEN as u64 {
            return Err(Error::protocol(format!(
                "frame ring corrupted: {avail} bytes published, less than a frame header"
            )));
        }
        let mask = self.data.len() - 1;
        let at = self.head as usize & mask;
        let mut raw = [0u8; FRAME_HEADER_LEN];
        self.data.read_wrapping(at, &mut raw);
        let header = FrameHeader::decode(&raw, self.data.len() - FRAME_HEADER_LEN)?;
        let need = frame_footprint(header.len as usize);
        if need as u64 > avail {
            return Err(Error::protocol(format!(
                "frame ring corrupted: a {}-byte frame claims more than the {avail} bytes published",
                need
            )));
        }
        let body = match header.len as usize {
            0 => Vec::new(),
            n => self.data.read_wrapping_to_vec((at + FRAME_HEADER_LEN) & mask, n),
        };
        self.head += need as u64;
        self.seg.ctl_u64(self.dir, layout::CTL_HEAD).store(self.head, Ordering::Release);
        Ok(Some(RawFrame { header, body: Bytes::from(body) }))
    }
}

/// One returned arena block: where it starts and the payload length the receiver saw.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ReleaseEntry {
    pub(crate) offset: u64,
    pub(crate) len: u64,
}

/// The receiver's end of a release ring: hands blocks of the peer's arena back.
#[derive(Debug)]
pub(crate) struct ReleaseProducer {
    seg: Arc<Segment>,
    dir: usize,
    data: Region,
    cap: u64,
    tail: u64,
    head_seen: u64,
}

impl ReleaseProducer {
    pub(crate) fn new(seg: Arc<Segment>, dir: usize) -> ReleaseProducer {
        let l = *seg.layout();
        let data = seg.region(l.rel_off[dir], l.rel_cap[dir] * RELEASE_ENTRY_LEN);
        ReleaseProducer { seg, dir, data, cap: l.rel_cap[dir] as u64, tail: 0, head_seen: 0 }
    }

    /// Publishes one release. The ring holds as many entries as the arena has granules, so an
    /// honest owner can never let it fill: full means the peer is misbehaving.
    pub(crate) fn push(&mut self, e: ReleaseEntry) -> Result<()> {
        if self.tail - self.head_seen >= self.cap {
            let head = self.seg.ctl_u64(self.dir, layout::CTL_REL_HEAD).load(Ordering::Acquire);
            if head > self.tail || head < self.head_seen {
                return Err(Error::protocol(format!("release ring corrupted: owner head {head} out of range")));
            }
            self.head_seen = head;
            if self.tail - head >= self.cap {
                return Err(Error::protocol("release ring full: the peer sent more arena blocks than its arena holds"));
            }
        }
        let mut b = [0u8; RELEASE_ENTRY_LEN];
        b[0..8].copy_from_slice(&e.offset.to_le_bytes());
        b[8..16].copy_from_slice(&e.len.to_le_bytes());
        let at = (self.tail % self.cap) as usize * RELEASE_ENTRY_LEN;
        self.data.write_wrapping(at, &b);
        self.tail += 1;
        self.seg.ctl_u64(self.dir, layout::CTL_REL_TAIL).store(self.tail, Ordering::Release);
        Ok(())
    }
}

/// The arena owner's end of a release ring.
#[derive(Debug)]
pub(crate) struct ReleaseConsumer {
    seg: Arc<Segment>,
    dir: usize,
    data: Region,
    cap: u64,
    head: u64,
}

impl ReleaseConsumer {
    pub(crate) fn new(seg: Arc<Segment>, dir: usize) -> ReleaseConsumer {
        let l = *seg.layout();
        let data = seg.region(l.rel_off[dir], l.rel_cap[dir] * RELEASE_ENTRY_LEN);
        ReleaseConsumer { seg, dir, data, cap: l.rel_cap[dir] as u64, head: 0 }
    }

    /// Takes every published release, handing each to `f` (which validates it).
    pub(crate) fn drain(&mut self, mut f: impl FnMut(ReleaseEntry) -> Result<()>) -> Result<usize> {
        let tail = self.seg.ctl_u64(self.dir, layout::CTL_REL_TAIL).load(Ordering::Acquire);
        let avail = tail.wrapping_sub(self.head);
        if avail > self.cap {
            return Err(Error::protocol(format!(
                "release ring corrupted: tail {tail} out of range (head {}, capacity {})",
                self.head, self.cap
            )));
        }
        for _ in 0..avail {
            let at = (self.head % self.cap) as usize * RELEASE_ENTRY_LEN;
            let mut b = [0u8; RELEASE_ENTRY_LEN];
            self.data.read_wrapping(at, &mut b);
            let (off, len) = b.split_at(8);
            let e = ReleaseEntry {
                offset: u64::from_le_bytes(off.try_into().map_err(|_| Error::protocol("release entry"))?),
                len: u64::from_le_bytes(len.try_into().map_err(|_| Error::protocol("release entry"))?),
            };
            self.head += 1;
            f(e)?;
        }
        if avail > 0 {
            self.seg.ctl_u64(self.dir, layout::CTL_REL_HEAD).store(self.head, Ordering::Release);
        }
        Ok(avail as usize)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::frame::Kind;
    use crate::layout::Layout;

    fn pair(ring: usize) -> (FrameProducer, FrameConsumer, Arc<Segment>) {
        let seg = Arc::new(Segment::heap(Layout::new([ring, ring], [64 << 10, 64 << 10], 0).expect("layout")));
        (FrameProducer::new(seg.clone(), 0), FrameConsumer::new(seg.clone(), 0), seg)
    }

    fn header(len: usize, stream: u64) -> FrameHeader {
        FrameHeader { len: len as u32, kind: Kind::Message, flags: 0, stream }
    }

    /// A naive reference: a VecDeque of frames. The ring must agree with it for every sequence
    /// of pushes and pops, including bodies that wrap around the end.
    #[test]
    fn agrees_with_a_queue_across_wraps() {
        let (mut p, mut c, _seg) = pair(4096);
        let mut model = std::collections::VecDeque::new();
        let mut rng = 0x9e3779b97f4a7c15u64;
        let mut next = || {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng
        };
        let mut stream = 0;
        // Fewer under Miri, which interprets each step: 1,500 still wrap the ring ~100 times.
        for _ in 0..if cfg!(miri) { 1_500 } else { 20_000 } {
            if next() % 3 != 0 {
                let len = match next() % 10 {
                    0 => 0,
                    1 => 4096 - FRAME_HEADER_LEN,
                    _ => (next() % 700) as usize,
                };
                let body: Vec<u8> = (0..len).map(|i| (i as u64 ^ stream) as u8).collect();
                let (a, b) = body.split_at(len / 3);
                if p.try_push(&header(len, stream), &[a, b]).expect("push") {
                    model.push_back((stream, body));
                    stream += 1;
                }
            } else {
                let got = c.try_pop().expect("pop");
                let want = model.pop_front();
                match (got, want) {
                    (None, None) => {}
                    (Some(f), Some((s, body))) => {
                        assert_eq!(f.header.stream, s);
                        assert_eq!(&f.body[..], &body[..]);
                    }
                    (g, w) => panic!("ring {g:?} != model {w:?}"),
                }
            }
        }
    }

    #[test]
    fn full_ring_refuses_then_accepts_after_pop() {
        let (mut p, mut c, _seg) = pair(4096);
        let big = vec![7u8; 2000];
        assert!(p.try_push(&header(2000, 1), &[&big]).expect("first"));
        assert!(p.try_push(&header(2000, 2), &[&big]).expect("second"));
        assert!(!p.try_push(&header(2000, 3), &[&big]).expect("third is full"));
        assert_eq!(c.try_pop().expect("pop").expect("frame").header.stream, 1);
        assert!(p.try_push(&header(2000, 3), &[&big]).expect("room again"));
        let too_big = vec![0u8; 4096];
        assert_eq!(p.try_push(&header(4096, 4), &[&too_big]).expect_err("too big").kind(), ErrorKind::TooLarge);
    }

    #[test]
    fn corrupted_cursors_are_errors_not_panics() {
        let (mut p, mut c, seg) = pair(4096);
        seg.ctl_u64(0, layout::CTL_TAIL).store(1 << 40, Ordering::Release);
        assert_eq!(c.try_pop().expect_err("tail far ahead").kind(), ErrorKind::Protocol);
        seg.ctl_u64(0, layout::CTL_TAIL).store(8, Ordering::Release);
        assert_eq!(c.try_pop().expect_err("short of a header").kind(), ErrorKind::Protocol);
        seg.ctl_u64(0, layout::CTL_HEAD).store(u64::MAX, Ordering::Release);
        let body = vec![0u8; 4000];
        assert!(p.try_push(&header(4000, 1), &[&body]).expect("fits first time"));
        assert_eq!(p.try_push(&header(4000, 1), &[&body]).expect_err("head garbage").kind(), ErrorKind::Protocol);
    }

    #[test]
    fn release_ring_round_trips_and_detects_overflow() {
        let seg = Arc::new(Segment::heap(Layout::new([4096, 4096], [64 << 10, 64 << 10], 0).expect("layout")));
        let mut p = ReleaseProducer::new(seg.clone(), 1);
        let mut c = ReleaseConsumer::new(seg.clone(), 1);
        for i in 0..16 {
            p.push(ReleaseEntry { offset: i * 4096, len: 10 }).expect("fits");
        }
        assert_eq!(p.push(ReleaseEntry { offset: 0, len: 1 }).expect_err("full").kind(), ErrorKind::Protocol);
        let mut seen = vec![];
        assert_eq!(
            c.drain(|e| {
                seen.push(e.offset);
                Ok(())
            })
            .expect("drain"),
            16
        );
        assert_eq!(seen, (0..16).map(|i| i * 4096).collect::<Vec<_>>());
        p.push(ReleaseEntry { offset: 0, len: 1 }).expect("room after drain");
    }
}
