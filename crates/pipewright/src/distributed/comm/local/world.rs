//! The threads' shared mailboxes: one box per (group, sender, receiver, tag), a condition
//! variable per receiving rank, the first failure every waiting rank reports, and the receive
//! that polls, then sleeps, until its message, a failure or the timeout.

use std::collections::{HashMap, VecDeque};
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use candle_core::Tensor;

use crate::{Error, Result};

/// (group id, sender world rank, receiver world rank, tag)
pub(super) type Key = (u64, usize, usize, u64);

pub(super) enum Msg {
    Tensors(Vec<Tensor>),
    /// A collective failed at its root; every member reports the same error.
    Failed(String),
}

#[derive(Default)]
pub(super) struct State {
    pub(super) boxes: HashMap<Key, VecDeque<Msg>>,
    /// The first rank failure: (rank, message).
    pub(super) failed: Option<(usize, String)>,
}

pub(super) struct World {
    pub(super) size: usize,
    pub(super) state: Mutex<State>,
    /// One per world rank, signalled when a message for that rank arrives (or any rank
    /// fails): a message wakes only its receiver. One for the whole world woke every waiting
    /// rank on every message, and with more ranks than cores those wake-ups took time slices
    /// from the ranks computing.
    pub(super) cvs: Vec<Condvar>,
    pub(super) timeout: Duration,
    /// How long a receive polls its mailbox before it sleeps on its condition variable.
    pub(super) spin: Duration,
}

impl World {
    pub(super) fn lock(&self) -> MutexGuard<'_, State> {
        // A rank that panicked while holding the lock cannot leave the mailboxes inconsistent
        // (every update is a single push or pop), so a poisoned lock is still usable.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(super) fn post(&self, key: Key, msg: Msg) {
        self.lock().boxes.entry(key).or_default().push_back(msg);
        self.cvs[key.2].notify_all();
    }

    pub(super) fn fail(&self, rank: usize, why: String) {
        let mut s = self.lock();
        if s.failed.is_none() {
            s.failed = Some((rank, why));
        }
        drop(s);
        for cv in &self.cvs {
            cv.notify_all();
        }
    }

    /// Waits for the next message under `key`.
    pub(super) fn take(&self, key: Key, me: usize, what: &str) -> Result<Vec<Tensor>> {
        let start = Instant::now();
        let mut s = self.lock();
        loop {
            if let Some(q) = s.boxes.get_mut(&key) {
                if let Some(m) = q.pop_front() {
                    // A collective's key is used once: an emptied box left behind grew the
                    // map by one entry per message, step after step (4 KB a step a rank here).
                    if q.is_empty() {
                        s.boxes.remove(&key);
                    }
                    return match m {
                        Msg::Tensors(t) => Ok(t),
                        Msg::Failed(why) => Err(Error::Comm(why)),
                    };
                }
            }
            if let Some((r, why)) = &s.failed {
                if *r != me {
                    return Err(Error::Comm(format!(
                        "rank {me}: {what} from rank {} abandoned because rank {r} failed: {why}",
                        key.1
                    )));
                }
            }
            let waited = start.elapsed();
            if waited >= self.timeout {
                return Err(Error::Comm(format!(
                    "rank {me}: {what} from rank {} timed out after {:.0?}: is rank {} running and \
                     sending it (same tag, same order of collectives)?",
                    key.1, waited, key.1
                )));
            }
            if waited < self.spin {
                // Poll: let the sender take the lock, look again.
                drop(s);
                for _ in 0..64 {
                    std::hint::spin_loop();
                }
                s = self.lock();
                continue;
            }
            let slice = (self.timeout - waited).min(Duration::from_millis(200));
            s = self.cvs[key.2]
                .wait_timeout(s, slice)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }
}
