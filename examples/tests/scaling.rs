//! `scaling` runs end to end on a tiny configuration (4 images per replica, one timed step,
//! 1 and 2 CPU replicas) and writes a PNG that decodes and a CSV with every measured,
//! projected and reference point.

use std::collections::BTreeSet;
use std::process::Command;

/// One CSV row: `(series, strategy, replicas, efficiency)`.
type Row = (String, String, usize, f64);

fn parse(csv: &str) -> anyhow::Result<Vec<Row>> {
    let mut lines = csv.lines();
    assert_eq!(
        lines.next(),
        Some("series,strategy,replicas,step_ms,images_per_s,efficiency")
    );
    lines
        .map(|line| {
            let cells: Vec<&str> = line.split(',').collect();
            assert_eq!(cells.len(), 6, "{line}");
            // Every number present is finite and positive; only Horovod's figure has no
            // step time or throughput.
            for cell in [cells[3], cells[4]] {
                if cells[0] != "reference" || !cell.is_empty() {
                    let v: f64 = cell.parse()?;
                    assert!(v.is_finite() && v > 0.0, "{line}");
                }
            }
            Ok((
                cells[0].to_string(),
                cells[1].to_string(),
                cells[2].parse()?,
                cells[5].parse()?,
            ))
        })
        .collect()
}

#[test]
fn tiny_run_writes_a_png_and_every_row() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let png_path = dir.path().join("out").join("scaling.png");
    let csv_path = dir.path().join("scaling.csv");
    let out = Command::new(env!("CARGO_BIN_EXE_scaling"))
        .args([
            "--batch-size-per-replica",
            "4",
            "--steps",
            "1",
            "--warmup",
            "0",
        ])
        .args(["--replicas", "1,2"])
        .args(["--output", &png_path.to_string_lossy()])
        .args(["--csv", &csv_path.to_string_lossy()])
        .output()?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("| strategy | N | step (ms) | images/s | efficiency |"));
    // Without `mpirun` (and without the `mpi` feature) multi-worker is reported as skipped.
    assert!(stdout.contains("multi-worker: skipped"), "{stdout}");

    let decoder = png::Decoder::new(std::io::BufReader::new(std::fs::File::open(&png_path)?));
    let mut reader = decoder.read_info()?;
    let mut pixels = vec![0; reader.output_buffer_size()];
    let frame = reader.next_frame(&mut pixels)?;
    assert_eq!((frame.width, frame.height), (1100, 700));
    // Not a blank canvas: a good share of the pixels is not white.
    let drawn = pixels
        .chunks(frame.color_type.samples())
        .filter(|p| p.iter().any(|&c| c < 200))
        .count();
    assert!(drawn > 5_000, "{drawn} drawn pixels");

    let rows = parse(&std::fs::read_to_string(&csv_path)?)?;
    let measured: BTreeSet<(&str, usize)> = rows
        .iter()
        .filter(|r| r.0 == "measured")
        .map(|r| (r.1.as_str(), r.2))
        .collect();
    let expected: BTreeSet<(&str, usize)> = [
        ("one_device", 1),
        ("mirrored", 1),
        ("mirrored", 2),
        ("central_storage", 1),
        ("central_storage", 2),
    ]
    .into();
    assert_eq!(measured, expected);
    for r in &rows {
        assert!(r.3.is_finite() && r.3 > 0.0, "{r:?}");
    }
    // The baseline is itself; projections start at 100% and never rise.
    assert!(rows.iter().any(|r| r.1 == "one_device" && r.3 == 1.0));
    for series in [
        "projected_measured_step",
        "projected_gpu_step",
        "projected_gpu_step_overlap",
    ] {
        let curve: Vec<&Row> = rows.iter().filter(|r| r.0 == series).collect();
        let ns: Vec<usize> = curve.iter().map(|r| r.2).collect();
        assert_eq!(ns, [1, 2, 4, 8, 16, 32, 64, 128, 256, 512], "{series}");
        assert_eq!(curve[0].3, 1.0);
        assert!(curve.windows(2).all(|w| w[1].3 <= w[0].3 && w[1].3 <= 1.0));
    }
    let reference = |name: &str, n: usize, efficiency: f64| {
        rows.iter()
            .any(|r| r.1 == name && r.2 == n && (r.3 - efficiency).abs() < 1e-4)
    };
    assert!(reference("keras_tutorial", 4, 63.0 / 64.0));
    assert!(reference("horovod", 512, 0.9));
    Ok(())
}
