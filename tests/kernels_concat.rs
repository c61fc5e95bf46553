//! Concatenation along channels.

mod kernel_support;

use candle_core::Tensor;
use kernel_support::random_var;

/// MiniGoogLeNet's concatenations at batch 64: `(branch channels, spatial size)`.
const MINI_GOOGLENET_CONCAT: &[(&[usize], usize)] = &[
    (&[32, 32], 32),
    (&[32, 48], 32),
    (&[80, 80], 15),
    (&[112, 48], 15),
    (&[96, 64], 15),
    (&[80, 80], 15),
    (&[48, 96], 15),
    (&[96, 144], 7),
    (&[176, 160], 7),
    (&[176, 160], 7),
];

#[test]
#[ignore = "timing; run on demand"]
fn time_mini_googlenet_concat() -> anyhow::Result<()> {
    let reps = 5;
    let mut total = (0.0, 0.0);
    for (i, &(parts, hw)) in MINI_GOOGLENET_CONCAT.iter().enumerate() {
        let vars = parts
            .iter()
            .enumerate()
            .map(|(j, &c)| random_var(&[64, c, hw, hw], (i * 10 + j) as u64, 0.0))
            .collect::<anyhow::Result<Vec<_>>>()?;
        let ts: Vec<&Tensor> = vars.iter().map(|v| v.as_tensor()).collect();
        let (fw, bw) = kernel_support::fwd_bwd_ms(reps, || Ok(Tensor::cat(&ts, 1)?))?;
        println!("{parts:?} x {hw}: {fw:6.2} + {bw:6.2}");
        total.0 += fw;
        total.1 += bw;
    }
    println!("total {:6.2} + {:6.2}", total.0, total.1);
    Ok(())
}
