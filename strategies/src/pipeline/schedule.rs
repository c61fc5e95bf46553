//! The order in which each stage of a pipeline runs its micro-batches' forward and backward
//! passes: GPipe (all forwards, then all backwards) or 1F1B (one forward, one backward).
//!
//! Both schedules leave each stage idle for the same share of a step, the pipeline's bubble:
//! `(S - 1) / (M + S - 1)` for `S` stages of equal cost and `M` micro-batches (GPipe's paper).
//! They differ in memory: under GPipe every stage holds the activations of all `M`
//! micro-batches at the end of its forwards; under 1F1B stage `s` starts backward passes after
//! `S - s` forwards and then alternates, so it never holds more than `min(S - s, M)`.
//!
//! The last stage runs each micro-batch's backward pass right after its forward pass, under
//! both schedules: its loss is at hand, and nothing waits on it in between.

/// How a pipeline orders its stages' forward and backward passes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Schedule {
    /// All micro-batches forward, then all backward (GPipe). Every stage holds every
    /// micro-batch's activations at once.
    GPipe,
    /// After a warm-up of forwards, one forward then one backward (PipeDream-Flush's 1F1B):
    /// the same bubble as GPipe, and stage `s` of `S` holds at most `S - s` micro-batches'
    /// activations. The default.
    #[default]
    OneFOneB,
}

impl std::str::FromStr for Schedule {
    type Err = kandle::Error;

    /// `gpipe` or `1f1b`.
    fn from_str(s: &str) -> kandle::Result<Self> {
        match s.to_ascii_lowercase().as_str() {
            "gpipe" => Ok(Schedule::GPipe),
            "1f1b" => Ok(Schedule::OneFOneB),
            other => Err(kandle::Error::invalid(format!(
                "unknown pipeline schedule `{other}`: use gpipe or 1f1b"
            ))),
        }
    }
}

impl std::fmt::Display for Schedule {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Schedule::GPipe => "gpipe",
            Schedule::OneFOneB => "1f1b",
        })
    }
}

/// One pass of one micro-batch on one stage.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Pass {
    /// The forward pass of micro-batch `m` (on the last stage, with its loss and backward).
    Forward(usize),
    /// The backward pass of micro-batch `m` (never on the last stage).
    Backward(usize),
}

impl Schedule {
    /// The passes stage `stage` of `stages` runs in a step of `micro` micro-batches, in order.
    /// Backward passes run in micro-batch order on every stage, so the gradients a stage sends
    /// arrive in the order the stage before it takes them.
    pub(crate) fn passes(self, stage: usize, stages: usize, micro: usize) -> Vec<Pass> {
        let forwards = (0..micro).map(Pass::Forward);
        if stage + 1 == stages {
            return forwards.collect();
        }
        let backwards = (0..micro).map(Pass::Backward);
        match self {
            Schedule::GPipe => forwards.chain(backwards).collect(),
            Schedule::OneFOneB => {
                let warm_up = (stages - 1 - stage).min(micro);
                let mut passes: Vec<Pass> = (0..warm_up).map(Pass::Forward).collect();
                for m in 0..micro - warm_up {
                    passes.push(Pass::Forward(warm_up + m));
                    passes.push(Pass::Backward(m));
                }
                passes.extend((micro - warm_up..micro).map(Pass::Backward));
                passes
            }
        }
    }

    /// The most micro-batches stage `stage` of `stages` holds at once, forwarded and not yet
    /// backwarded, in a step of `micro` micro-batches.
    pub(crate) fn held(self, stage: usize, stages: usize, micro: usize) -> usize {
        let mut held: usize = 0;
        let mut most = 0;
        for pass in self.passes(stage, stages, micro) {
            match pass {
                Pass::Forward(_) if stage + 1 == stages => most = most.max(1),
                Pass::Forward(_) => held += 1,
                Pass::Backward(_) => held = held.saturating_sub(1),
            }
            most = most.max(held);
        }
        most
    }
}

/// The idle share of a step of `stages` stages of equal cost and `micro` micro-batches:
/// `(S - 1) / (M + S - 1)`.
pub fn ideal_idle_fraction(stages: usize, micro: usize) -> f64 {
    let (s, m) = (stages as f64, micro as f64);
    (s - 1.0) / (m + s - 1.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs the schedule's passes on `stages` stages whose forward pass takes `forward` and
    /// backward pass `backward` time units (the last stage runs both for each micro-batch),
    /// each stage in its order and each pass once its input has arrived; returns the idle
    /// fraction of the step. Panics if the schedule deadlocks.
    fn simulate(schedule: Schedule, stages: usize, micro: usize, f: u64, b: u64) -> f64 {
        let orders: Vec<Vec<Pass>> = (0..stages)
            .map(|s| schedule.passes(s, stages, micro))
            .collect();
        // When each stage's forward and backward output of each micro-batch is ready.
        let mut forward_done = vec![vec![None::<u64>; micro]; stages];
        let mut backward_done = vec![vec![None::<u64>; micro]; stages];
        let mut next = vec![0usize; stages];
        let mut clock = vec![0u64; stages];
        let mut busy = 0;
        loop {
            let mut progressed = false;
            for s in 0..stages {
                let Some(&pass) = orders[s].get(next[s]) else {
                    continue;
                };
                let last = s + 1 == stages;
                let ready = match pass {
                    Pass::Forward(_) if s == 0 => Some(0),
                    Pass::Forward(m) => forward_done[s - 1][m],
                    Pass::Backward(m) => backward_done[s + 1][m],
                };
                let Some(ready) = ready else { continue };
                let cost = match pass {
                    Pass::Forward(_) if last => f + b,
                    Pass::Forward(_) => f,
                    Pass::Backward(_) => b,
                };
                let end = clock[s].max(ready) + cost;
                clock[s] = end;
                busy += cost;
                match pass {
                    Pass::Forward(m) if last => {
                        forward_done[s][m] = Some(end);
                        backward_done[s][m] = Some(end);
                    }
                    Pass::Forward(m) => forward_done[s][m] = Some(end),
                    Pass::Backward(m) => backward_done[s][m] = Some(end),
                }
                next[s] += 1;
                progressed = true;
            }
            if (0..stages).all(|s| next[s] == orders[s].len()) {
                break;
            }
            assert!(
                progressed,
                "{schedule} deadlocks with {stages} stages and {micro}"
            );
        }
        let span = *clock.iter().max().expect("a stage");
        1.0 - busy as f64 / (stages as u64 * span) as f64
    }

    #[test]
    fn both_schedules_leave_the_bubble_of_gpipes_paper() {
        for schedule in [Schedule::GPipe, Schedule::OneFOneB] {
            for stages in 1..=4 {
                for micro in [1, 2, 4, 8] {
                    let idle = simulate(schedule, stages, micro, 1, 2);
                    let ideal = ideal_idle_fraction(stages, micro);
                    assert!(
                        (idle - ideal).abs() < 1e-12,
                        "{schedule}, S={stages}, M={micro}: {idle} against {ideal}"
                    );
                }
            }
        }
    }

    #[test]
    fn one_f_one_b_holds_at_most_the_stages_after_it() {
        for stages in 1..=4 {
            for micro in [1, 2, 4, 8] {
                for s in 0..stages {
                    let last = s + 1 == stages;
                    let gpipe = Schedule::GPipe.held(s, stages, micro);
                    let one = Schedule::OneFOneB.held(s, stages, micro);
                    assert_eq!(gpipe, if last { 1 } else { micro });
                    assert_eq!(one, (stages - s).min(micro), "S={stages} M={micro} s={s}");
                }
            }
        }
    }

    #[test]
    fn every_micro_batch_runs_once_each_way() {
        for schedule in [Schedule::GPipe, Schedule::OneFOneB] {
            let passes = schedule.passes(0, 3, 5);
            for m in 0..5 {
                assert_eq!(passes.iter().filter(|p| **p == Pass::Forward(m)).count(), 1);
                assert_eq!(
                    passes.iter().filter(|p| **p == Pass::Backward(m)).count(),
                    1
                );
                let f = passes.iter().position(|p| *p == Pass::Forward(m));
                let b = passes.iter().position(|p| *p == Pass::Backward(m));
                assert!(f < b, "{schedule}: micro-batch {m} backward before forward");
            }
        }
        assert_eq!("1F1B".parse::<Schedule>().ok(), Some(Schedule::OneFOneB));
        assert!("zigzag".parse::<Schedule>().is_err());
    }
}
