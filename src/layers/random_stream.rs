//! The random stream of a layer that draws in training (dropout masks, augmentations): draw `k`
//! comes from the layer's seed (drawn at build time from the model's seed) and `k`, the layer's
//! position, which lives in a variable on the layer's device saved with the weights
//! ([`BuildContext::generator_position`]). Dropout draws its masks where the position lives,
//! from Philox at counter `k` ([`crate::kernels::dropout`]); the augmentations, which run on the
//! host, seed a host generator with the seed and `k` ([`RandomStream::next`]). Either way a
//! seeded run is repeatable on any device, and a run resumed from a backup draws what an
//! uninterrupted one would.

use candle_core::{Tensor, Var};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::BuildContext;
use crate::Result;

/// A layer's seeded, resumable sequence of generators.
pub(crate) struct RandomStream {
    seed: u64,
    /// How many generators the layer has drawn, as `[count / 2^24, count % 2^24]` (exact in
    /// `f32`).
    position: Var,
}

/// `2^24`: below it every integer is exact in `f32`.
const F32_EXACT: u64 = 1 << 24;

/// SplitMix64's finaliser: nearby inputs give unrelated seeds.
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

impl RandomStream {
    /// A stream for the layer being built in `ctx`, its position saved as `<scope>.generator`.
    pub(crate) fn new(ctx: &mut BuildContext) -> Result<Self> {
        let seed = ctx.rng().random();
        Ok(Self {
            seed,
            position: ctx.generator_position("generator")?,
        })
    }

    /// The layer's seed: the key of the masks [`kernels::dropout::draw_mask`] draws.
    ///
    /// [`kernels::dropout::draw_mask`]: crate::kernels::dropout::draw_mask
    pub(crate) fn seed(&self) -> u64 {
        self.seed
    }

    /// The layer's position, on its device: where the next draw starts.
    pub(crate) fn position(&self) -> &Var {
        &self.position
    }

    /// The next generator of the sequence, on the host; moves the layer to the one after.
    pub(crate) fn next(&self) -> Result<StdRng> {
        let parts = self.position.as_tensor().to_vec1::<f32>()?;
        let (high, low) = match parts.as_slice() {
            [high, low] => (*high as u64, *low as u64),
            _ => (0, 0),
        };
        let position = high * F32_EXACT + low;
        let next = position + 1;
        let next = [(next / F32_EXACT) as f32, (next % F32_EXACT) as f32];
        self.position
            .set(&Tensor::new(&next, self.position.device())?)?;
        Ok(StdRng::seed_from_u64(mix(self.seed ^ mix(position))))
    }
}
