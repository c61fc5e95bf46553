//! A stage's links to its neighbours in other processes: MPI point-to-point messages between
//! the ranks of one pipeline (the same replica column), tagged by kind and micro-batch.
//!
//! Neighbouring stages send each other large messages at the same time (an activation one way,
//! a gradient the other), and a large send completes only once its receiver takes it, so a
//! rank that sends also takes what its neighbours send, and keeps it until its schedule asks
//! for it. While it waits or sends it also answers the chief's requests for its stage's state
//! ([`super::state`]), since the chief may ask in the middle of a step of this rank's.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use candle_core::{DType, Device, Tensor};
use mpi::datatype::Equivalence;
use mpi::point_to_point::{Destination, Source};
use mpi::topology::{Communicator, SimpleCommunicator};

use kandle::strategy::Replica;
use kandle::Error;

use super::state;
use crate::mpi::abort::abort_job;
use crate::mpi::poll::{Backoff, SendPace};
use crate::mpi::world::World;
use crate::pipeline::stage_run::{Links, StageError};

/// Tags of the activation of micro-batch `m` (`ACTIVATION | m`) and of its gradient.
const ACTIVATION: i32 = 0x6000;
const GRADIENT: i32 = 0x7000;
/// Micro-batches a step may have: their index fits in the tag's low bits.
pub(crate) const MAX_MICRO_BATCHES: usize = 0x1000;

/// One stage's neighbours among the ranks, for one call.
pub(crate) struct RankLinks<'a> {
    pub(crate) world: &'a World,
    /// The stage, to answer the chief's requests for its state with.
    pub(crate) replica: &'a Replica,
    pub(crate) previous: Option<usize>,
    pub(crate) next: Option<usize>,
    /// Each micro-batch's samples.
    pub(crate) micro_sizes: Vec<usize>,
    /// One sample's shape as this stage takes it, and as it gives it.
    pub(crate) input_shape: Vec<usize>,
    pub(crate) output_shape: Vec<usize>,
    pub(crate) device: Device,
    pub(crate) timeout: Duration,
    /// Messages taken early, by sender and tag.
    early: HashMap<(usize, i32), Vec<f32>>,
    waited: Duration,
}

impl<'a> RankLinks<'a> {
    /// Links to `previous` and `next` (ranks) for micro-batches of `micro_sizes` samples.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        world: &'a World,
        replica: &'a Replica,
        previous: Option<usize>,
        next: Option<usize>,
        micro_sizes: Vec<usize>,
        shapes: (Vec<usize>, Vec<usize>),
        device: Device,
        timeout: Duration,
    ) -> Self {
        Self {
            world,
            replica,
            previous,
            next,
            micro_sizes,
            input_shape: shapes.0,
            output_shape: shapes.1,
            device,
            timeout,
            early: HashMap::new(),
            waited: Duration::ZERO,
        }
    }

    /// The messages this rank may be sent in this call: each micro-batch's activation from the
    /// rank before and gradient from the rank after.
    fn expected(&self) -> Vec<(usize, i32)> {
        let micro = self.micro_sizes.len() as i32;
        let from_previous = self
            .previous
            .map(|p| (0..micro).map(move |m| (p, ACTIVATION | m)));
        let from_next = self
            .next
            .map(|n| (0..micro).map(move |m| (n, GRADIENT | m)));
        from_previous
            .into_iter()
            .flatten()
            .chain(from_next.into_iter().flatten())
            .collect()
    }

    /// Takes every expected message that has arrived, keeping it for later.
    fn take_arrived(&mut self, comm: &SimpleCommunicator) {
        for (rank, tag) in self.expected() {
            if self.early.contains_key(&(rank, tag)) {
                continue;
            }
            if let Some((message, status)) = comm
                .process_at_rank(rank as i32)
                .immediate_matched_probe_with_tag(tag)
            {
                let n = status.count(f32::equivalent_datatype()).max(0) as usize;
                let mut words = vec![0f32; n];
                message.matched_receive_into(&mut words[..]);
                self.early.insert((rank, tag), words);
            }
        }
    }

    /// Waits for the message `tag` from `rank`, a tensor of `samples` samples of `shape`.
    fn receive(
        &mut self,
        rank: usize,
        tag: i32,
        samples: usize,
        shape: &[usize],
    ) -> Result<Tensor, StageError> {
        let start = Instant::now();
        let deadline = start + self.timeout;
        let mut backoff = Backoff::default();
        let words = loop {
            if let Some(words) = self.early.remove(&(rank, tag)) {
                break words;
            }
            if Instant::now() >= deadline {
                return Err(StageError::Own(Error::Replica {
                    replica: crate::mpi::worker_label(rank),
                    reason: format!(
                        "sent this pipeline stage nothing for {} within {}",
                        describe(tag),
                        crate::mpi::seconds(self.timeout)
                    ),
                }));
            }
            let replica = self.replica;
            self.world.point_to_point(|comm| {
                state::answer_requests(comm, replica, self.timeout)?;
                self.take_arrived(comm);
                Ok(())
            })?;
            backoff.wait();
        };
        self.waited += start.elapsed();
        let mut dims = vec![samples];
        dims.extend(shape);
        if words.len() != dims.iter().product::<usize>() {
            return Err(StageError::Own(Error::invalid(format!(
                "{} from {} holds {} values where {dims:?} takes {}",
                describe(tag),
                crate::mpi::worker_label(rank),
                words.len(),
                dims.iter().product::<usize>()
            ))));
        }
        Ok(Tensor::from_vec(words, dims, &Device::Cpu)?.to_device(&self.device)?)
    }

    /// Sends `tensor` with `tag` to `rank`, taking what the neighbours send meanwhile. A send
    /// its receiver does not take within the timeout cannot be taken back: the job is ended.
    fn send(&mut self, rank: usize, tag: i32, tensor: &Tensor) -> Result<(), StageError> {
        let words = tensor
            .to_dtype(DType::F32)?
            .flatten_all()?
            .to_device(&Device::Cpu)?
            .to_vec1::<f32>()?;
        let replica = self.replica;
        let timeout = self.timeout;
        self.world.point_to_point(|comm| {
            let deadline = Instant::now() + timeout;
            mpi::request::scope(|scope| {
                let mut request = Some(comm.process_at_rank(rank as i32).immediate_send_with_tag(
                    scope,
                    &words[..],
                    tag,
                ));
                let mut pace = SendPace::default();
                loop {
                    if let Some(pending) = request.take() {
                        if let Err(pending) = pending.test() {
                            request = Some(pending);
                        }
                    }
                    if request.is_none() {
                        return Ok(());
                    }
                    self.take_arrived(comm);
                    if let Err(e) = state::answer_requests(comm, replica, timeout) {
                        std::mem::forget(request);
                        abort_job(comm, &e.to_string())
                    }
                    if Instant::now() >= deadline {
                        let why = format!(
                            "{} did not take {} within {}",
                            crate::mpi::worker_label(rank),
                            describe(tag),
                            crate::mpi::seconds(timeout)
                        );
                        // MPI still owns the send's buffer: abort without dropping it.
                        std::mem::forget(request);
                        abort_job(comm, &why)
                    }
                    pace.wait();
                }
            })
        })?;
        Ok(())
    }
}

/// What a tag carries, for messages.
fn describe(tag: i32) -> String {
    let m = tag & 0x0fff;
    match tag & !0x0fff {
        ACTIVATION => format!("the activation of micro-batch {m}"),
        _ => format!("the gradient of micro-batch {m}"),
    }
}

impl Links for RankLinks<'_> {
    fn has_previous(&self) -> bool {
        self.previous.is_some()
    }

    fn has_next(&self) -> bool {
        self.next.is_some()
    }

    fn activation(&mut self, m: usize) -> Result<Tensor, StageError> {
        let rank = self.previous.ok_or(StageError::NeighbourStopped)?;
        let shape = self.input_shape.clone();
        self.receive(rank, ACTIVATION | m as i32, self.micro_sizes[m], &shape)
    }

    fn send_activation(&mut self, m: usize, y: Tensor) -> Result<(), StageError> {
        match self.next {
            Some(rank) => self.send(rank, ACTIVATION | m as i32, &y),
            None => Ok(()),
        }
    }

    fn gradient(&mut self, m: usize) -> Result<Tensor, StageError> {
        let rank = self.next.ok_or(StageError::NeighbourStopped)?;
        let shape = self.output_shape.clone();
        self.receive(rank, GRADIENT | m as i32, self.micro_sizes[m], &shape)
    }

    fn send_gradient(&mut self, m: usize, dx: Tensor) -> Result<(), StageError> {
        match self.previous {
            Some(rank) => self.send(rank, GRADIENT | m as i32, &dx),
            None => Ok(()),
        }
    }

    fn waited(&self) -> Duration {
        self.waited
    }
}
