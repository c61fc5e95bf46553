//! Ending the whole job: a started MPI operation that cannot complete (a collective a worker
//! left, a send whose receiver never takes it) can neither be taken back nor have its buffers
//! released, so the job ends with `MPI_Abort` after the reason is logged. Everything that can
//! still fail with an error does so instead; these are the last resort.

use mpi::request::{Request, Scope};
use mpi::topology::{Communicator, SimpleCommunicator};

use super::watchdog::{self, Phase, Vigil};

/// The error code `MPI_Abort` reports when an operation that already started cannot complete.
const ABORT_CODE: i32 = 70;

/// Waits for a started MPI collective; if it cannot complete, ends the whole job, since MPI can
/// neither take it back nor release its buffers. Names the workers that no longer answer first.
pub(crate) fn complete_or_abort<'a, D: ?Sized, S: Scope<'a>>(
    vigil: &mut Vigil<'_>,
    request: Request<'a, D, S>,
    phase: Phase,
    what: &str,
) {
    if let Err(unfinished) = watchdog::complete(vigil, request) {
        let diagnosis = vigil.diagnosis();
        let comm = vigil.communicator();
        log::error!(
            "worker {}: the {what} of {phase} started but did not complete within {}: \
             {diagnosis}; MPI cannot cancel a collective, so the job is aborted",
            comm.rank(),
            vigil.patience(),
        );
        // MPI still owns the request's buffers; `MPI_Abort` never returns, so they stay valid.
        std::mem::forget(unfinished);
        comm.abort(ABORT_CODE)
    }
}

/// Ends the whole job after logging `why`: for a started MPI operation that cannot complete,
/// since MPI can neither take it back nor release its buffers. Never returns.
pub(crate) fn abort_job(comm: &SimpleCommunicator, why: &str) -> ! {
    log::error!("rank {}: {why}; the job is aborted", comm.rank());
    comm.abort(ABORT_CODE)
}
