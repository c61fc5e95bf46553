//! How a rank waits between polls of MPI (`MPI_Improbe`, `MPI_Test`): every poll is also what
//! moves a non-blocking operation forward, so a waiting rank keeps polling, but it should cost
//! little CPU while it waits long (the other ranks may share the cores).

use std::time::Duration;

/// Yields for the first polls (each poll is an MPI call, which is also what moves a
/// non-blocking collective forward), then sleeps a little longer each time, up to 1 ms, so a
/// long wait costs little CPU (the other workers may share the cores).
#[derive(Default)]
pub(crate) struct Backoff(u32);

/// Polls that only yield before the first sleep.
const YIELDING_POLLS: u32 = 2000;

impl Backoff {
    /// Yields or sleeps, a little longer each time.
    pub(crate) fn wait(&mut self) {
        if self.0 < YIELDING_POLLS {
            std::thread::yield_now();
        } else {
            let micros = 50u64 << (self.0 - YIELDING_POLLS).min(5);
            std::thread::sleep(Duration::from_micros(micros.min(1000)));
        }
        self.0 = self.0.saturating_add(1);
    }
}

/// How a sender waits between tests of a send under way. A large message moves in pieces as
/// both sides call MPI, so the sender calls it often: it yields for a while, then sleeps only
/// briefly ([`Backoff`], which grows to 1 ms, would make every piece wait).
#[derive(Default)]
pub(crate) struct SendPace(u32);

impl SendPace {
    /// Yields, or sleeps 20 µs after the first few hundred calls.
    pub(crate) fn wait(&mut self) {
        if self.0 < 256 {
            self.0 += 1;
            std::thread::yield_now();
        } else {
            std::thread::sleep(Duration::from_micros(20));
        }
    }
}
