//! A tiny lossless WebP writer for tests: the `image` crate reads WebP but its pure-Rust build
//! writes none, so the tests of WebP input encode their images here.
//!
//! [`solid_webp`] writes a one-colour image as a VP8L bitstream with five single-symbol
//! ("simple") prefix codes, so that every pixel takes zero bits; see the WebP lossless
//! bitstream specification (RFC 9649).

/// Bits written least significant first, as VP8L reads them.
struct Bits {
    bytes: Vec<u8>,
    used: u32,
}

impl Bits {
    fn put(&mut self, value: u32, count: u32) {
        for i in 0..count {
            if self.used.is_multiple_of(8) {
                self.bytes.push(0);
            }
            let bit = ((value >> i) & 1) as u8;
            if let Some(last) = self.bytes.last_mut() {
                *last |= bit << (self.used % 8);
            }
            self.used += 1;
        }
    }

    /// A prefix code of the one 8-bit symbol `symbol`: simple code, one symbol, 8 bits.
    fn single_symbol_code(&mut self, symbol: u8) {
        self.put(1, 1);
        self.put(0, 1);
        self.put(1, 1);
        self.put(u32::from(symbol), 8);
    }
}

/// A lossless WebP file of `width × height` (each 1 to 16384) pixels, all `rgb`, opaque.
pub fn solid_webp(width: u32, height: u32, rgb: [u8; 3]) -> Vec<u8> {
    assert!((1..=16384).contains(&width) && (1..=16384).contains(&height));
    let mut bits = Bits {
        bytes: vec![0x2f],
        used: 8,
    };
    bits.put(width - 1, 14);
    bits.put(height - 1, 14);
    bits.put(0, 1); // alpha unused
    bits.put(0, 3); // version 0
    bits.put(0, 1); // no transform
    bits.put(0, 1); // no colour cache
    bits.put(0, 1); // no meta prefix codes
                    // Green (and length prefixes), red, blue, alpha, distance.
    for symbol in [rgb[1], rgb[0], rgb[2], 255, 0] {
        bits.single_symbol_code(symbol);
    }
    let mut data = bits.bytes;
    let chunk_len = data.len() as u32;
    if !data.len().is_multiple_of(2) {
        data.push(0);
    }
    let mut file = Vec::with_capacity(20 + data.len());
    file.extend_from_slice(b"RIFF");
    file.extend_from_slice(&(4 + 8 + data.len() as u32).to_le_bytes());
    file.extend_from_slice(b"WEBPVP8L");
    file.extend_from_slice(&chunk_len.to_le_bytes());
    file.extend_from_slice(&data);
    file
}
