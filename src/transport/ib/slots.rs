//! The slot protocol's arithmetic, kept apart from the verbs calls so it can be tested alone:
//! the immediate values that announce a slot's bytes or return credits, the sender's window
//! (which slots it may write next) and the receiver's queue of arrived slots.
//!
//! Each side's receive ring has [`SLOTS`] slots of [`SLOT_BYTES`] bytes. The sender writes
//! slots in order, round robin, each with an immediate naming the slot and its length; the
//! receiver hands the bytes out in that order and, once a slot is read to its end, returns a
//! credit (a write with an immediate flagged as credit, counting the slots freed). A slot is
//! written again only when the peer credited it and the write that last used its staging copy
//! completed, so the sender never overwrites an unread slot nor a staging slot the NIC reads.

use std::collections::VecDeque;

/// Slots per ring.
pub const SLOTS: usize = 8;
/// Bytes per slot: a multiple of 8, so every slot boundary falls on an 8-aligned stream offset
/// and no element of a reduced payload straddles two slots.
pub const SLOT_BYTES: usize = 512 << 10;
/// Receives kept posted: the peer may have up to [`SLOTS`] data writes and [`SLOTS`] credit
/// writes that this side has not polled yet; two spare.
pub const RECVS: usize = 2 * SLOTS + 2;
/// Credit writes in flight at most (each frees at least one slot, so fewer than this is
/// always enough; a credit waiting for room just accumulates).
pub const MAX_CREDIT_WRITES: usize = SLOTS + 2;

const CREDIT_FLAG: u32 = 1 << 31;
const LEN_BITS: u32 = 20;
const SLOT_BITS: u32 = 11;

const _: () = assert!(SLOT_BYTES.is_multiple_of(8) && SLOT_BYTES < 1 << LEN_BITS);
const _: () = assert!(SLOTS < 1 << SLOT_BITS);

/// What an immediate value says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Imm {
    /// `len` bytes arrived in slot `slot`.
    Data {
        /// Slot index, `0..SLOTS`.
        slot: u32,
        /// Bytes, `1..=SLOT_BYTES`.
        len: u32,
    },
    /// The peer read `n` more of our slots.
    Credit(u32),
}

impl Imm {
    /// The 32-bit immediate: bit 31 credit flag; data: slot in bits 20..31, length below.
    pub fn encode(self) -> u32 {
        match self {
            Imm::Data { slot, len } => {
                debug_assert!(slot < 1 << SLOT_BITS && len < 1 << LEN_BITS);
                (slot << LEN_BITS) | len
            }
            Imm::Credit(n) => CREDIT_FLAG | (n & !CREDIT_FLAG),
        }
    }

    /// Reads an immediate back.
    pub fn decode(imm: u32) -> Imm {
        if imm & CREDIT_FLAG != 0 {
            Imm::Credit(imm & !CREDIT_FLAG)
        } else {
            Imm::Data {
                slot: imm >> LEN_BITS,
                len: imm & ((1 << LEN_BITS) - 1),
            }
        }
    }
}

/// The sender's view of the peer's ring: slots written, credited and completed, all counted
/// from the start (u64: they never wrap).
#[derive(Debug, Clone, Default)]
pub struct Window {
    /// Data writes posted.
    pub posted: u64,
    /// Slots the peer returned.
    pub credited: u64,
    /// Data writes completed locally (their staging slot is free again).
    pub completed: u64,
}

impl Window {
    /// Slots that may be written now.
    pub fn free(&self) -> usize {
        let done = self.credited.min(self.completed);
        SLOTS - (self.posted - done) as usize
    }

    /// The slot the next write goes to.
    pub fn next_slot(&self) -> usize {
        (self.posted % SLOTS as u64) as usize
    }

    /// Takes `n` credits from the peer; an error when it returns more than was written.
    pub fn credit(&mut self, n: u32) -> Result<(), String> {
        let credited = self.credited + n as u64;
        if n == 0 || credited > self.posted {
            return Err(format!(
                "credit of {n} slot(s) with {} of {} outstanding",
                self.posted - self.credited,
                self.posted
            ));
        }
        self.credited = credited;
        Ok(())
    }

    /// A data write completed (they complete in order).
    pub fn completed_one(&mut self) -> Result<(), String> {
        if self.completed == self.posted {
            return Err("a write completed that was never posted".into());
        }
        self.completed += 1;
        Ok(())
    }

    /// True when every posted write completed.
    pub fn drained(&self) -> bool {
        self.completed == self.posted
    }
}

/// The receiver's view of its own ring: slots that arrived, in order, and how far the first
/// one is read.
#[derive(Debug, Clone, Default)]
pub struct Arrivals {
    /// (slot, bytes) in arrival order.
    queue: VecDeque<(usize, usize)>,
    /// Bytes of the first queued slot already handed out.
    offset: usize,
    /// Slots that ever arrived.
    arrived: u64,
    /// Slots read to their end and not credited yet.
    pub owed: u32,
}

impl Arrivals {
    /// Notes a slot's arrival; an error when it is not the slot expected or its length is
    /// impossible (a peer out of step).
    pub fn arrive(&mut self, slot: u32, len: u32) -> Result<(), String> {
        let want = (self.arrived % SLOTS as u64) as u32;
        if slot != want || len == 0 || len as usize > SLOT_BYTES {
            return Err(format!(
                "unexpected slot announcement (slot {slot} of {len} bytes; expected slot {want})"
            ));
        }
        if self.queue.len() == SLOTS {
            return Err(format!(
                "slot {slot} written while all {SLOTS} slots were unread (credits broken)"
            ));
        }
        self.arrived += 1;
        self.queue.push_back((slot as usize, len as usize));
        Ok(())
    }

    /// The unread part of the first arrived slot, as (byte offset in the ring, bytes).
    pub fn front(&self) -> Option<(usize, usize)> {
        self.queue
            .front()
            .map(|&(slot, len)| (slot * SLOT_BYTES + self.offset, len - self.offset))
    }

    /// Marks `n` bytes of the front slot read (at most what `front` gave); a slot read to its
    /// end is owed back to the sender.
    pub fn consume(&mut self, n: usize) {
        let Some(&(_, len)) = self.queue.front() else {
            return;
        };
        self.offset += n;
        debug_assert!(self.offset <= len);
        if self.offset >= len {
            self.queue.pop_front();
            self.offset = 0;
            self.owed += 1;
        }
    }

    /// True when nothing unread arrived.
    pub fn is_empty(&self) -> bool {
        self.queue.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn immediates_round_trip() {
        for imm in [
            Imm::Data { slot: 0, len: 1 },
            Imm::Data {
                slot: SLOTS as u32 - 1,
                len: SLOT_BYTES as u32,
            },
            Imm::Credit(1),
            Imm::Credit(SLOTS as u32),
        ] {
            assert_eq!(Imm::decode(imm.encode()), imm);
        }
        assert_eq!(Imm::Credit(3).encode(), 0x8000_0003);
        assert_eq!(Imm::Data { slot: 2, len: 8 }.encode(), (2 << 20) | 8);
    }

    #[test]
    fn the_window_waits_for_credit_and_completion() {
        let mut w = Window::default();
        assert_eq!(w.free(), SLOTS);
        for i in 0..SLOTS {
            assert_eq!(w.next_slot(), i);
            w.posted += 1;
        }
        assert_eq!(w.free(), 0);
        // Credited but the staging copy not yet sent: still busy.
        w.credit(2).unwrap();
        assert_eq!(w.free(), 0);
        w.completed_one().unwrap();
        assert_eq!(w.free(), 1);
        w.completed_one().unwrap();
        w.completed_one().unwrap();
        assert_eq!(w.free(), 2);
        assert_eq!(w.next_slot(), 0);
        // More credit than outstanding writes is a protocol error.
        assert!(w.credit(SLOTS as u32).unwrap_err().contains("credit of 8"));
        assert!(w.credit(0).is_err());
        let mut fresh = Window::default();
        assert!(fresh.completed_one().is_err());
        assert!(fresh.drained());
    }

    #[test]
    fn arrivals_are_read_in_order_and_owed_back() {
        let mut a = Arrivals::default();
        assert_eq!(a.front(), None);
        a.arrive(0, 100).unwrap();
        a.arrive(1, 16).unwrap();
        assert!(a.arrive(3, 8).unwrap_err().contains("expected slot 2"));
        assert!(a.arrive(2, 0).is_err());
        assert!(a.arrive(2, SLOT_BYTES as u32 + 1).is_err());
        assert_eq!(a.front(), Some((0, 100)));
        a.consume(40);
        assert_eq!(a.front(), Some((40, 60)));
        assert_eq!(a.owed, 0);
        a.consume(60);
        assert_eq!(a.owed, 1);
        assert_eq!(a.front(), Some((SLOT_BYTES, 16)));
        a.consume(16);
        assert!(a.is_empty());
        assert_eq!(a.owed, 2);
        // A full ring refuses one more.
        let mut full = Arrivals::default();
        for s in 0..SLOTS as u32 {
            full.arrive(s, 8).unwrap();
        }
        assert!(full.arrive(0, 8).unwrap_err().contains("credits broken"));
    }

    proptest! {
        /// A sender and a receiver driven in random steps through the window and arrivals:
        /// bytes come out in order, the window never lets a slot be written twice unread.
        #[test]
        fn random_schedules_keep_order_and_never_overrun(
            steps in proptest::collection::vec((0u8..4, 1usize..3 * SLOT_BYTES / 2), 1..200)
        ) {
            let mut w = Window::default();
            let mut a = Arrivals::default();
            let mut in_flight: VecDeque<(u32, u32)> = VecDeque::new();
            let (mut sent, mut read) = (0u64, 0u64);
            for (what, n) in steps {
                match what {
                    0 if w.free() > 0 => {
                        let len = n.min(SLOT_BYTES) as u32;
                        in_flight.push_back((w.next_slot() as u32, len));
                        w.posted += 1;
                        sent += len as u64;
                    }
                    1 => {
                        if let Some((slot, len)) = in_flight.pop_front() {
                            prop_assert!(a.arrive(slot, len).is_ok());
                            w.completed_one().unwrap();
                        }
                    }
                    2 => {
                        if let Some((_, avail)) = a.front() {
                            let k = n.min(avail);
                            a.consume(k);
                            read += k as u64;
                        }
                    }
                    _ => {
                        if a.owed > 0 {
                            w.credit(a.owed).unwrap();
                            a.owed = 0;
                        }
                    }
                }
                prop_assert!(read <= sent);
            }
        }
    }
}
