//! Launching `mpirun` from a test: output captured line by line, every launch under a deadline
//! and killed past it, one launch at a time.

use std::io::{BufRead, BufReader, Read};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// The launches share 2 cores: one at a time, so that timings mean something.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

/// The longest any launch may take before it is killed and the test fails.
pub const DEADLINE: Duration = Duration::from_secs(300);

/// The time-out the failure tests give the strategy (`--timeout-secs`), in seconds.
pub const TIMEOUT_SECS: u64 = 5;

/// The worker programs' arguments for a run in which worker 1 fails with an error of its own
/// (`failing on purpose before step 4`) after 3 steps.
pub const WORKER_1_FAILS: [&str; 6] = [
    "train",
    "--stall-worker",
    "1",
    "--stall-after-steps",
    "3",
    "--fail",
];

/// How long a failure may take to end the job: `timeouts` time-outs, plus time for mpirun to
/// start and tear down.
pub fn bound(timeouts: u64) -> Duration {
    Duration::from_secs(timeouts * TIMEOUT_SECS + 20)
}

/// `mpirun -n <ranks> <program> <args>`, with output captured.
pub fn mpirun(program: &str, ranks: usize, args: &[&str]) -> Command {
    let mut cmd = Command::new("mpirun");
    cmd.args(["-n", &ranks.to_string(), "--oversubscribe", program])
        .args(args)
        // Allowed when CI runs as root; ignored otherwise.
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    cmd
}

/// What a finished launch did.
pub struct Outcome {
    /// mpirun's exit status.
    pub status: ExitStatus,
    /// stdout, then stderr.
    pub output: String,
    /// From the start to the end of the launch.
    pub elapsed: Duration,
}

impl Outcome {
    /// Where the process labelled `label` (`worker 0/2`, `rank 1/4`) said it stopped for a
    /// stop signal: the `epoch E step S (...)` of its line `<label> stopped by ... at ...`.
    pub fn stopped_at(&self, label: &str) -> Option<String> {
        self.output
            .lines()
            .find_map(|l| l.strip_prefix(&format!("{label} stopped by ")))
            .map(|rest| rest.split(" at ").nth(1).unwrap_or_default().to_string())
    }

    /// Asserts that the launch failed and said `want`.
    pub fn assert_failed_with(&self, want: &str) {
        assert!(!self.status.success(), "{}", self.output);
        assert!(self.output.contains(want), "{}", self.output);
    }

    /// Asserts that the launch failed and that one line of its output said one of `wants`
    /// (a failure that can surface at more than one rank, each saying it in its own words).
    pub fn assert_failed_with_one_of(&self, wants: &[&str]) {
        assert!(!self.status.success(), "{}", self.output);
        let said = self
            .output
            .lines()
            .any(|line| wants.iter().any(|want| line.contains(want)));
        assert!(said, "none of {wants:?} in:\n{}", self.output);
    }

    /// Asserts that the launch ended within `limit`.
    pub fn assert_took_less_than(&self, limit: Duration) {
        assert!(self.elapsed < limit, "took {:?}", self.elapsed);
    }
}

/// Reads a child's stdout line by line on a thread (so a test can react to it) and its stderr
/// whole, and waits for it with [`DEADLINE`].
pub struct Launch {
    child: Child,
    lines: mpsc::Receiver<String>,
    stdout: Vec<String>,
    stderr: std::thread::JoinHandle<String>,
    start: Instant,
}

impl Launch {
    /// Starts `cmd`, reading its output.
    pub fn start(mut cmd: Command) -> anyhow::Result<Self> {
        let start = Instant::now();
        let mut child = cmd
            .spawn()
            .map_err(|e| anyhow::anyhow!("cannot start mpirun (is Open MPI installed?): {e}"))?;
        let stdout = child
            .stdout
            .take()
            .ok_or_else(|| anyhow::anyhow!("no stdout"))?;
        let mut stderr = child
            .stderr
            .take()
            .ok_or_else(|| anyhow::anyhow!("no stderr"))?;
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout)
                .lines()
                .map_while(std::result::Result::ok)
            {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let stderr = std::thread::spawn(move || {
            let mut s = String::new();
            let _ = stderr.read_to_string(&mut s);
            s
        });
        Ok(Self {
            child,
            lines,
            stdout: Vec::new(),
            stderr,
            start,
        })
    }

    /// Waits for a stdout line satisfying `want` and returns it.
    pub fn wait_for_line(&mut self, want: impl Fn(&str) -> bool) -> anyhow::Result<String> {
        loop {
            let left = DEADLINE.saturating_sub(self.start.elapsed());
            let Ok(line) = self.lines.recv_timeout(left) else {
                stop(&mut self.child);
                anyhow::bail!("no such line; output so far:\n{}", self.stdout.join("\n"));
            };
            self.stdout.push(line.clone());
            if want(&line) {
                return Ok(line);
            }
        }
    }

    /// Waits for the end, within [`DEADLINE`].
    pub fn finish(mut self) -> anyhow::Result<Outcome> {
        let status = loop {
            if let Some(status) = self.child.try_wait()? {
                break status;
            }
            if self.start.elapsed() > DEADLINE {
                stop(&mut self.child);
                anyhow::bail!("mpirun still running after {DEADLINE:?}: killed");
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        let elapsed = self.start.elapsed();
        // The reader thread ends when mpirun's stdout closes.
        while let Ok(line) = self.lines.recv_timeout(Duration::from_secs(5)) {
            self.stdout.push(line);
        }
        let stderr = self
            .stderr
            .join()
            .map_err(|_| anyhow::anyhow!("stderr reader panicked"))?;
        Ok(Outcome {
            status,
            output: format!("{}\n{stderr}", self.stdout.join("\n")),
            elapsed,
        })
    }
}

/// Starts `cmd`, waits for the line that starts with `process` and gives its pid (`... pid P`)
/// and then for the line `then`, sends `signal` (`-KILL`, `-STOP`) to that process, and returns
/// how the launch ended.
pub fn signal_after(
    cmd: Command,
    process: &str,
    then: &str,
    signal: &str,
) -> anyhow::Result<Outcome> {
    let mut launch = Launch::start(cmd)?;
    let pid_line = launch.wait_for_line(|l| l.starts_with(process) && l.contains(" pid "))?;
    let pid = pid_line
        .rsplit(' ')
        .next()
        .ok_or_else(|| anyhow::anyhow!("no pid in `{pid_line}`"))?
        .to_string();
    launch.wait_for_line(|l| l == then)?;
    let sent = Command::new("kill").args([signal, &pid]).status()?;
    anyhow::ensure!(sent.success(), "kill {signal} {pid} failed");
    launch.finish()
}

/// Ends a launch that overran: SIGTERM first, so that mpirun takes its workers down with it,
/// then SIGKILL.
pub fn stop(child: &mut Child) {
    let _ = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status();
    for _ in 0..100 {
        if let Ok(Some(_)) = child.try_wait() {
            return;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let _ = child.kill();
    let _ = child.wait();
}

/// Runs `cmd` to its end, within [`DEADLINE`].
pub fn run(cmd: Command) -> anyhow::Result<Outcome> {
    Launch::start(cmd)?.finish()
}

/// The first line of `output` that starts with `prefix`, and the test accuracy it gives: the
/// number after `test accuracy ` (a fraction, or a percentage whose `%` is dropped).
pub fn test_accuracy(output: &str, prefix: &str) -> anyhow::Result<(String, f64)> {
    let line = output
        .lines()
        .find(|l| l.starts_with(prefix))
        .ok_or_else(|| anyhow::anyhow!("no line starting with `{prefix}`:\n{output}"))?;
    let accuracy = line
        .split("test accuracy ")
        .nth(1)
        .and_then(|rest| rest.split(['%', ' ', ',']).next())
        .and_then(|a| a.parse().ok())
        .ok_or_else(|| anyhow::anyhow!("cannot read the accuracy of `{line}`"))?;
    Ok((line.to_string(), accuracy))
}

/// What a training binary run under `mpirun` by [`train_under_mpirun`] left.
pub struct TrainingRun {
    /// The launch's exit status and output.
    pub outcome: Outcome,
    /// Where it wrote its checkpoint (`--checkpoint`).
    pub checkpoint: std::path::PathBuf,
    /// Where it saved its final training state (`--save`).
    pub state: std::path::PathBuf,
}

/// Runs `program` (a binary such as `quickstart`) under `mpirun -n ranks` with `args`, its plot,
/// checkpoint and final training state (`--plot`, `--checkpoint`, `--save`) written into `dir`,
/// one launch at a time, and checks that it succeeded.
pub fn train_under_mpirun(
    program: &str,
    ranks: usize,
    args: &[&str],
    dir: &std::path::Path,
) -> anyhow::Result<TrainingRun> {
    let (plot, checkpoint, state) = (
        dir.join("quickstart.png"),
        dir.join("quickstart.safetensors"),
        dir.join("state.safetensors"),
    );
    let (plot_arg, checkpoint_arg, state_arg) = (
        plot.to_string_lossy().to_string(),
        checkpoint.to_string_lossy().to_string(),
        state.to_string_lossy().to_string(),
    );
    let mut all = args.to_vec();
    all.extend([
        "--plot",
        &plot_arg,
        "--checkpoint",
        &checkpoint_arg,
        "--save",
        &state_arg,
    ]);
    let _one = lock();
    let outcome = run(mpirun(program, ranks, &all))?;
    anyhow::ensure!(outcome.status.success(), "{}", outcome.output);
    Ok(TrainingRun {
        outcome,
        checkpoint,
        state,
    })
}

/// One launch at a time in this test binary.
pub fn lock() -> std::sync::MutexGuard<'static, ()> {
    ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner())
}

/// Runs the worker program's `train` task through `launch` (its `mpirun`, given the program's
/// arguments) with the failure tests' time-out, worker `worker` stalling after `after` steps;
/// checks that the job fails, names the stall with `want` within `bound(timeouts)`, and returns
/// how it ended.
pub fn stalled_run(
    launch: impl Fn(&[&str]) -> Command,
    (worker, after): (usize, usize),
    want: &str,
    timeouts: u64,
) -> anyhow::Result<Outcome> {
    let _one = lock();
    let (timeout, worker, after) = (
        TIMEOUT_SECS.to_string(),
        worker.to_string(),
        after.to_string(),
    );
    let outcome = run(launch(&[
        "--timeout-secs",
        &timeout,
        "train",
        "--stall-worker",
        &worker,
        "--stall-after-steps",
        &after,
    ]))?;
    outcome.assert_failed_with(want);
    outcome.assert_took_less_than(bound(timeouts));
    Ok(outcome)
}
