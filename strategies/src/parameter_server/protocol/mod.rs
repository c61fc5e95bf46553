//! The parameter servers' protocol: every message between workers and servers as a typed
//! [`Message`], its [`Kind`] and what it carries; `encoding`: its one encoding on the wire.
//!
//! Each kind, who sends it, its fields and payload in the order `encoding` writes them, and
//! what answers it:
//!
//! | kind | from | fields after the call number | payload | answer |
//! |---|---|---|---|---|
//! | `Hello` | worker | model signature, values in a step buffer | | `Weights`, or `Abort` |
//! | `Pull` | worker | | | `Weights` |
//! | `Push` | worker | base version, step, learning rate | the server's part of the step buffer | `Weights` once applied |
//! | `Fetch` | worker | | | `Weights` |
//! | `Test` | worker, to server 0 | evaluation step, samples | loss and metric sums | `TestTotals` once every worker sent its own |
//! | `Epoch` | worker | epoch, staleness sum, count and max, samples | the epoch's loss and metric sums | from server 0, `EpochTotals` once every worker ended the epoch |
//! | `End` | worker | | | `Weights` (the final ones) once every worker ended the call |
//! | `StateRequest` | worker | | | `State` |
//! | `Load` | worker | what it loads (weights or optimizer state), bytes | a training state's bytes | `Weights` once every worker sent its own (the chief's is loaded) |
//! | `Gather` | worker, to server 0 | | 64-bit values | `Gathered` once every worker sent its own |
//! | `Alive` | worker | | | (keeps the other servers from taking a worker that waits on one server for a stalled one) |
//! | `Weights` | server | version, applied (0 or 1), staleness, samples, number of sums | loss and metric sums, then the server's variables | |
//! | `TestTotals` | server 0 | samples | the sums over every worker | |
//! | `EpochTotals` | server 0 | as `Epoch`, without the epoch | the sums over every worker | |
//! | `Gathered` | server 0 | | every worker's values, in rank order | |
//! | `State` | server | version, bytes | its shard's training state (weights and optimizer state), as bytes | (between calls, a server sends it to every other rank unasked) |
//! | `Shard` | server, to the other servers | as `Weights` | as `Weights` | (at the end of a call: every server then holds every variable) |
//! | `Waiting` | server | | | (keeps a waiting worker's deadline from passing) |
//! | `Abort` | any | bytes of the culprit, bytes of the reason | the culprit's name, then the reason, as text | |

mod encoding;

pub(crate) use encoding::Encoded;

/// What a message is, sent as its MPI tag.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(i32)]
pub(crate) enum Kind {
    /// Worker to server: the model's signature when the model is built.
    Hello = 0x5001,
    /// Worker to server: send me your current weights, I train on them.
    Pull = 0x5002,
    /// Worker to server: gradients of one step.
    Push = 0x5003,
    /// Worker to server: send me your current weights, to evaluate or predict with.
    Fetch = 0x5004,
    /// Worker to server 0: the sums of one evaluation step.
    Test = 0x5005,
    /// Worker to server: this worker ended an epoch.
    Epoch = 0x5006,
    /// Worker to server: this worker ended the current `fit`, `evaluate` or `predict`.
    End = 0x5007,
    /// Worker to server: still alive, waiting for another server.
    Alive = 0x5008,
    /// Worker to server: send me your shard's training state.
    StateRequest = 0x5009,
    /// Worker to server: load this training state's weights or optimizer state.
    Load = 0x500a,
    /// Worker to server 0: values to gather from every worker.
    Gather = 0x500b,
    /// Server to worker: weights, and what the step they answer did.
    Weights = 0x5011,
    /// Server 0 to worker: an evaluation step's sums over every worker.
    TestTotals = 0x5012,
    /// Anyone to anyone: the job failed.
    Abort = 0x5013,
    /// Server to a worker it makes wait: still alive, still waiting for the others.
    Waiting = 0x5014,
    /// Server to server: its variables at the end of a call.
    Shard = 0x5015,
    /// Server to any rank: a shard's training state.
    State = 0x5016,
    /// Server 0 to worker: an epoch's totals over every worker.
    EpochTotals = 0x5017,
    /// Server 0 to worker: every worker's gathered values.
    Gathered = 0x5018,
}

impl Kind {
    /// Every kind, to find one by its tag.
    const ALL: [Kind; 19] = [
        Kind::Hello,
        Kind::Pull,
        Kind::Push,
        Kind::Fetch,
        Kind::Test,
        Kind::Epoch,
        Kind::End,
        Kind::Alive,
        Kind::StateRequest,
        Kind::Load,
        Kind::Gather,
        Kind::Weights,
        Kind::TestTotals,
        Kind::Abort,
        Kind::Waiting,
        Kind::Shard,
        Kind::State,
        Kind::EpochTotals,
        Kind::Gathered,
    ];

    /// The MPI tag of this kind.
    pub(crate) fn tag(self) -> i32 {
        self as i32
    }

    /// The kind whose MPI tag is `tag`, if any.
    pub(crate) fn of_tag(tag: i32) -> Option<Kind> {
        Kind::ALL.into_iter().find(|k| k.tag() == tag)
    }
}

/// Which part of a training state a [`Message::Load`] loads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum LoadPart {
    /// The weights.
    Weights = 0,
    /// The optimizer state.
    Optimizer = 1,
}

/// A server's variables, and what the step it answers did (in [`Message::Weights`] and
/// [`Message::Shard`]).
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Snapshot {
    /// The server's version: the number of updates it applied.
    pub(crate) version: u64,
    /// When it answers a push that an update applied: the update's staleness (how many updates
    /// the server applied between the weights the gradients were computed on and the update).
    pub(crate) staleness: Option<u64>,
    /// Samples of the step it answers (0 when it answers none).
    pub(crate) samples: u64,
    /// Loss and metric sums of the step it answers (zeros when it answers none).
    pub(crate) sums: Vec<f32>,
    /// The server's variables, fused in store order.
    pub(crate) values: Vec<f32>,
}

/// An evaluation step's sums: one worker's (in [`Message::Test`]) or every worker's (in
/// [`Message::TestTotals`]).
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct StepTotals {
    /// Samples evaluated.
    pub(crate) samples: u64,
    /// Loss and metric sums.
    pub(crate) sums: Vec<f32>,
}

impl StepTotals {
    /// Adds `other` to these totals.
    pub(crate) fn add(&mut self, other: &StepTotals) {
        self.samples += other.samples;
        add_sums(&mut self.sums, &other.sums);
    }
}

/// The staleness of the updates that applied a worker's steps, or every worker's.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Staleness {
    /// Sum of the staleness of every update.
    pub(crate) sum: u64,
    /// Number of updates.
    pub(crate) count: u64,
    /// The largest staleness.
    pub(crate) max: u64,
}

impl Staleness {
    /// Counts one more update, `staleness` updates stale.
    pub(crate) fn record(&mut self, staleness: u64) {
        self.sum += staleness;
        self.count += 1;
        self.max = self.max.max(staleness);
    }

    /// Adds `other`'s updates to these.
    pub(crate) fn add(&mut self, other: Staleness) {
        self.sum += other.sum;
        self.count += other.count;
        self.max = self.max.max(other.max);
    }

    /// The mean staleness (0 without updates).
    pub(crate) fn mean(&self) -> f64 {
        if self.count > 0 {
            self.sum as f64 / self.count as f64
        } else {
            0.0
        }
    }
}

/// An epoch's training totals: one worker's (in [`Message::Epoch`]) or every worker's (in
/// [`Message::EpochTotals`]).
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct EpochTotals {
    /// The staleness of the updates that applied the epoch's steps.
    pub(crate) staleness: Staleness,
    /// Samples of the epoch's training steps.
    pub(crate) samples: u64,
    /// Loss and metric sums of the epoch's training steps.
    pub(crate) sums: Vec<f32>,
}

impl EpochTotals {
    /// Adds `other` to these totals.
    pub(crate) fn add(&mut self, other: &EpochTotals) {
        self.staleness.add(other.staleness);
        self.samples += other.samples;
        add_sums(&mut self.sums, &other.sums);
    }
}

/// Adds `more` to `sums` element-wise, the shorter taken as padded with zeros.
fn add_sums(sums: &mut Vec<f32>, more: &[f32]) {
    sums.resize(sums.len().max(more.len()), 0.0);
    for (s, v) in sums.iter_mut().zip(more) {
        *s += v;
    }
}

/// One message between workers and servers.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Message {
    /// Worker to server, when the model is built: what it built.
    Hello {
        /// A digest of the model's variables and step layout.
        signature: u64,
        /// Values in the worker's whole step buffer.
        buffer_len: u64,
    },
    /// Worker to server: send me your current weights, I train on them.
    Pull,
    /// Worker to server: its part of one step's buffer.
    Push {
        /// The version of the server's weights the step was computed on.
        base: u64,
        /// The worker's step in the call, from 1.
        step: u32,
        /// The learning rate the worker trains with.
        lr: f64,
        /// The server's part of the worker's step buffer.
        buffer: Vec<f32>,
    },
    /// Worker to server: send me your current weights, to evaluate or predict with.
    Fetch,
    /// Worker to server 0: the sums of one evaluation step on its part of the batch.
    Test {
        /// The worker's evaluation step in the call, from 1.
        step: u32,
        /// Its samples and sums.
        totals: StepTotals,
    },
    /// Worker to server: this worker ended an epoch.
    Epoch {
        /// The worker's epoch in the call, from 1.
        epoch: u32,
        /// Its training totals over the epoch.
        totals: EpochTotals,
    },
    /// Worker to server: this worker ended the call.
    End,
    /// Worker to server: still alive, waiting for another server.
    Alive,
    /// Worker to server: send me your shard's training state.
    StateRequest,
    /// Worker to server: load `part` of this training state.
    Load {
        /// What to load.
        part: LoadPart,
        /// The training state, as bytes.
        state: Vec<u8>,
    },
    /// Worker to server 0: values to gather from every worker.
    Gather {
        /// This worker's values.
        values: Vec<u64>,
    },
    /// Server to worker: its variables, and what the step they answer did.
    Weights(Snapshot),
    /// Server 0 to worker: an evaluation step's sums over every worker.
    TestTotals(StepTotals),
    /// Server 0 to worker: an epoch's totals over every worker.
    EpochTotals(EpochTotals),
    /// Server 0 to worker: every worker's gathered values.
    Gathered {
        /// Every worker's values, in rank order.
        values: Vec<u64>,
    },
    /// Server to a worker it makes wait: still alive, still waiting for the others.
    Waiting,
    /// Server to any rank: its shard's training state.
    State {
        /// The server's version.
        version: u64,
        /// Its shard's training state (weights and optimizer state), as bytes.
        state: Vec<u8>,
    },
    /// Server to server, at the end of a call: its variables.
    Shard(Snapshot),
    /// Anyone to anyone: the job failed.
    Abort {
        /// Who failed, e.g. `worker 1`.
        culprit: String,
        /// What happened.
        reason: String,
    },
}

impl Message {
    /// What the message is.
    pub(crate) fn kind(&self) -> Kind {
        match self {
            Message::Hello { .. } => Kind::Hello,
            Message::Pull => Kind::Pull,
            Message::Push { .. } => Kind::Push,
            Message::Fetch => Kind::Fetch,
            Message::Test { .. } => Kind::Test,
            Message::Epoch { .. } => Kind::Epoch,
            Message::End => Kind::End,
            Message::Alive => Kind::Alive,
            Message::StateRequest => Kind::StateRequest,
            Message::Load { .. } => Kind::Load,
            Message::Gather { .. } => Kind::Gather,
            Message::Weights(_) => Kind::Weights,
            Message::TestTotals(_) => Kind::TestTotals,
            Message::EpochTotals(_) => Kind::EpochTotals,
            Message::Gathered { .. } => Kind::Gathered,
            Message::Waiting => Kind::Waiting,
            Message::State { .. } => Kind::State,
            Message::Shard(_) => Kind::Shard,
            Message::Abort { .. } => Kind::Abort,
        }
    }
}
