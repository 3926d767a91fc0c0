//! The rounding hook of the oracle: none for the f64 reference, or an element type's precision
//! for the naive low-precision computation.

use distflash_kernels::ElemType;

/// Rounding applied after every operation of the oracle.
pub type Rounding = fn(f64) -> f64;

/// No rounding: the f64 reference.
pub fn exact(x: f64) -> f64 {
    x
}

/// The rounding of an element type (f32, f16 or bf16 precision).
pub fn rounding_of(elem: ElemType) -> Rounding {
    match elem {
        ElemType::F32 => |x| x as f32 as f64,
        ElemType::F16 => |x| half::f16::from_f64(x).to_f64(),
        ElemType::BF16 => |x| half::bf16::from_f64(x).to_f64(),
    }
}

/// Rounding used for the naive low-precision computation of `elem` that the tolerance rule
/// compares against ([`rounding_of`] under the name the checks use).
pub fn naive_rounding(elem: ElemType) -> Rounding {
    rounding_of(elem)
}
