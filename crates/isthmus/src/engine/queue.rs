//! A FIFO queue that keeps its first item inline.
//!
//! A call's queues (its inbox of events, the messages it read early) hold one item at a time far more often than several; a `VecDeque` allocates for the first
//! item already, once per call, and this allocates only when a second item waits.

use std::collections::VecDeque;

/// A FIFO queue whose first item needs no allocation.
#[derive(Debug)]
pub(crate) struct Queue<T> {
    first: Option<T>,
    rest: VecDeque<T>,
}

impl<T> Default for Queue<T> {
    fn default() -> Queue<T> {
        Queue { first: None, rest: VecDeque::new() }
    }
}

impl<T> Queue<T> {
    pub(crate) fn push_back(&mut self, item: T) {
        if self.first.is_none() && self.rest.is_empty() {
            self.first = Some(item);
        } else {
            self.rest.push_back(item);
        }
    }

    pub(crate) fn pop_front(&mut self) -> Option<T> {
        self.first.take().or_else(|| self.rest.pop_front())
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.first.is_none() && self.rest.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::Queue;

    /// Against a `VecDeque`, every mix of pushes and pops keeps the same order.
    #[test]
    fn matches_a_vecdeque_under_any_mix_of_operations() {
        let mut seed = 0x2545_f491_4f6c_dd1du64;
        let (mut q, mut model) = (Queue::default(), std::collections::VecDeque::new());
        for i in 0..20_000u32 {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            if seed % 3 == 0 {
                assert_eq!(q.pop_front(), model.pop_front(), "queue and model part at step {i}");
            } else {
                q.push_back(i);
                model.push_back(i);
            }
            assert_eq!(q.is_empty(), model.is_empty());
        }
    }

    #[test]
    fn keeps_fifo_order_across_the_inline_slot() {
        let mut q = Queue::default();
        assert!(q.is_empty());
        q.push_back(1);
        q.push_back(2);
        q.push_back(3);
        assert_eq!(q.pop_front(), Some(1));
        q.push_back(4);
        assert_eq!(std::iter::from_fn(|| q.pop_front()).collect::<Vec<_>>(), [2, 3, 4]);
        assert!(q.is_empty());
    }
}
