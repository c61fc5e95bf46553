//! Philox4x32-10, the counter-based generator of Salmon, Moraes, Dror and Shaw ("Parallel random
//! numbers: as easy as 1, 2, 3", SC 2011), as Random123, cuRAND, PyTorch and TensorFlow run it:
//! four 32-bit words from a 128-bit counter and a 64-bit key, in ten rounds. Any word of the
//! stream is a pure function of where it is, so the CPU and a GPU draw the same bits in any
//! order and with any number of threads, and a draw needs no state beyond its position.
//! `cuda/dropout.cu` holds the same rounds in CUDA C.

/// The rounds' multipliers.
const M0: u32 = 0xD251_1F53;
const M1: u32 = 0xCD9E_8D57;
/// The key's increments between rounds (the golden ratio's and `sqrt(3) - 1`'s bits).
const W0: u32 = 0x9E37_79B9;
const W1: u32 = 0xBB67_AE85;

/// One round: two 32x32 -> 64-bit products, their halves mixed with the other words and the key.
#[inline(always)]
fn round(ctr: [u32; 4], key: [u32; 2]) -> [u32; 4] {
    let p0 = u64::from(M0) * u64::from(ctr[0]);
    let p1 = u64::from(M1) * u64::from(ctr[2]);
    [
        (p1 >> 32) as u32 ^ ctr[1] ^ key[0],
        p1 as u32,
        (p0 >> 32) as u32 ^ ctr[3] ^ key[1],
        p0 as u32,
    ]
}

/// The four words Philox4x32-10 gives for `ctr` under `key`.
#[inline]
pub(crate) fn philox4x32_10(mut ctr: [u32; 4], mut key: [u32; 2]) -> [u32; 4] {
    ctr = round(ctr, key);
    for _ in 1..10 {
        key = [key[0].wrapping_add(W0), key[1].wrapping_add(W1)];
        ctr = round(ctr, key);
    }
    ctr
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn random123s_known_answers() {
        // Random123's `kat_vectors` for philox4x32 with 10 rounds.
        let cases = [
            (
                [0u32; 4],
                [0u32; 2],
                [0x6627_e8d5, 0xe169_c58d, 0xbc57_ac4c, 0x9b00_dbd8],
            ),
            (
                [u32::MAX; 4],
                [u32::MAX; 2],
                [0x408f_276d, 0x41c8_3b0e, 0xa20b_c7c6, 0x6d54_51fd],
            ),
            (
                [0x243f_6a88, 0x85a3_08d3, 0x1319_8a2e, 0x0370_7344],
                [0xa409_3822, 0x299f_31d0],
                [0xd16c_fe09, 0x94fd_cceb, 0x5001_e420, 0x2412_6ea1],
            ),
        ];
        for (ctr, key, want) in cases {
            assert_eq!(
                philox4x32_10(ctr, key),
                want,
                "counter {ctr:x?}, key {key:x?}"
            );
        }
    }

    #[test]
    fn neighbouring_counters_give_unrelated_words() {
        // Half of the bits flip, on average, between consecutive counters.
        let mut flipped = 0u32;
        let n = 4096u32;
        for i in 0..n {
            let a = philox4x32_10([i, 0, 7, 0], [1, 2]);
            let b = philox4x32_10([i + 1, 0, 7, 0], [1, 2]);
            flipped += a
                .iter()
                .zip(b)
                .map(|(x, y)| (x ^ y).count_ones())
                .sum::<u32>();
        }
        let mean = f64::from(flipped) / f64::from(n * 128);
        assert!((mean - 0.5).abs() < 0.01, "{mean}");
    }
}
