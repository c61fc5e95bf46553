//! The greedy placement of `ParameterServerStrategy` balances MiniGoogLeNet's variables over 1,
//! 2 and 3 servers: each variable whole, the servers' loads within one variable of each other.

use candle_core::Device;
use kandle::prelude::*;
use kandle::strategy::{ModelSpec, Replica};
use kandle_strategies::partition::{partition, server_loads};

#[test]
fn mini_googlenet_is_balanced_over_one_two_and_three_servers() -> anyhow::Result<()> {
    let spec = ModelSpec {
        network: kandle_models::mini_googlenet(10).into(),
        input_shapes: vec![vec![3, 32, 32]],
        optimizer: Box::new(Sgd::new(0.01).momentum(0.9)),
        loss: kandle::Objective::new(CategoricalCrossentropy::new()),
        metrics: Metrics::default(),
        seed: 0,
        compute_path: kandle::ComputePath::default(),
        dtype_policy: kandle::DTypePolicy::default(),
    };
    let replica = Replica::new(&spec, &Device::Cpu)?;
    // What the servers hold: every variable but dropout's generator positions.
    let sizes: Vec<usize> = replica
        .store()
        .iter()
        .filter(|p| !p.generator)
        .map(|p| p.var.elem_count())
        .collect();
    let total: usize = sizes.iter().sum();
    let largest = sizes.iter().copied().max().unwrap_or(0);
    eprintln!(
        "MiniGoogLeNet: {} variables, {total} values ({:.2} MB as f32), the largest {largest}",
        sizes.len(),
        total as f64 * 4.0 / 1e6
    );
    for servers in 1..=3 {
        let placed = partition(&sizes, servers)?;
        let loads = server_loads(&sizes, &placed, servers);
        let (max, min) = (
            *loads.iter().max().unwrap_or(&0),
            *loads.iter().min().unwrap_or(&0),
        );
        eprintln!(
            "{servers} server(s): {} values each (max/mean {:.4})",
            loads
                .iter()
                .map(|l| l.to_string())
                .collect::<Vec<_>>()
                .join(", "),
            max as f64 * servers as f64 / total as f64
        );
        assert_eq!(loads.iter().sum::<usize>(), total);
        assert!(max - min <= largest, "{servers} servers: {loads:?}");
        // Here the greedy placement comes within 1% of a perfect split.
        assert!(
            (max as f64) <= 1.01 * total as f64 / servers as f64,
            "{servers} servers: {loads:?}"
        );
    }
    Ok(())
}
