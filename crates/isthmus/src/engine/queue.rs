//! A FIFO queue that keeps its first item inline.
//!
//! A call's queues (its inbox of events, the messages it read early, the frames of a gRPC body)
//! hold one item at a time far more often than several; a `VecDeque` allocates for the first
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

    pub(crate) fn push_front(&mut self, item: T) {
        if let Some(old) = self.first.replace(item) {
            self.rest.push_front(old);
        }
    }

    pub(crate) fn pop_front(&mut self) -> Option<T> {
        self.first.take().or_else(|| self.rest.pop_front())
    }

    pub(crate) fn front_mut(&mut self) -> Option<&mut T> {
        if self.first.is_none() {
            self.first = self.rest.pop_front();
        }
        self.first.as_mut()
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.first.is_none() && self.rest.is_empty()
    }

    pub(crate) fn iter(&self) -> impl Iterator<Item = &T> {
        self.first.iter().chain(self.rest.iter())
    }
}

#[cfg(test)]
mod tests {
    use super::Queue;

    #[test]
    fn keeps_fifo_order_across_the_inline_slot() {
        let mut q = Queue::default();
        assert!(q.is_empty());
        q.push_back(1);
        q.push_back(2);
        q.push_back(3);
        assert_eq!(q.pop_front(), Some(1));
        q.push_back(4);
        q.push_front(0);
        assert_eq!(q.iter().copied().collect::<Vec<_>>(), [0, 2, 3, 4]);
        *q.front_mut().expect("front") += 10;
        assert_eq!(std::iter::from_fn(|| q.pop_front()).collect::<Vec<_>>(), [10, 2, 3, 4]);
        assert!(q.is_empty());
        assert_eq!(q.front_mut(), None);
    }
}
