//! [`FlatLayout`]: a model's float parameters laid end to end, in the module's visiting order
//! (the same on every rank), as one vector padded with zeros to a multiple of the world size;
//! gathering the weights into such a vector (in f32), and writing one back into the parameters
//! (in each parameter's own float type). The gradients are read from it in ranges
//! ([`FlatPieces`]), never gathered whole.

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{DType, Tensor};

use super::flat_pieces::FlatPieces;

/// One parameter's place in the flat vector.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Slot {
    id: ParamId,
    shape: Vec<usize>,
    dtype: DType,
}

impl Slot {
    fn len(&self) -> usize {
        self.shape.iter().product()
    }
}

/// Where every float parameter of a model lies in one flat vector of `padded` elements: the
/// parameters in visiting order, then zeros up to a multiple of the world size, so that rank `r`
/// of `P` owns elements `r * shard .. (r + 1) * shard` (`shard = padded / P`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FlatLayout {
    slots: Vec<Slot>,
    len: usize,
    padded: usize,
    world: usize,
}

impl FlatLayout {
    /// The layout of `model`'s float parameters over `world` ranks (`world >= 1`).
    pub fn of<B: AutodiffBackend, M: Module<B>>(model: &M, world: usize) -> Self {
        let mut visitor = Slots(Vec::new());
        model.visit(&mut visitor);
        let slots = visitor.0;
        let len = slots.iter().map(Slot::len).sum::<usize>();
        let world = world.max(1);
        Self {
            slots,
            len,
            padded: len.div_ceil(world) * world,
            world,
        }
    }

    /// A layout of `len` elements over `world` ranks without parameters behind them, for tests
    /// of what only the sizes decide.
    #[cfg(test)]
    pub(crate) fn of_len(len: usize, world: usize) -> Self {
        Self {
            slots: Vec::new(),
            len,
            padded: len.div_ceil(world) * world,
            world,
        }
    }

    /// Number of parameters (tensors).
    pub fn num_tensors(&self) -> usize {
        self.slots.len()
    }

    /// Number of parameter elements, padding excluded.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the model has no float parameter element.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Length of the flat vector: [`len`](Self::len) rounded up to a multiple of the world size.
    pub fn padded(&self) -> usize {
        self.padded
    }

    /// Elements each rank owns: `padded / world`.
    pub fn shard_len(&self) -> usize {
        self.padded / self.world
    }

    /// The world size the layout is padded for.
    pub fn world(&self) -> usize {
        self.world
    }

    /// Bytes of the parameters in their own float types (padding excluded).
    pub fn weight_bytes(&self) -> usize {
        self.slots.iter().map(|s| s.len() * s.dtype.size()).sum()
    }

    /// Where parameter `id` lies in the flat vector: its first element's index and its shape;
    /// `None` for an id that is not one of the layout's parameters.
    pub fn place(&self, id: ParamId) -> Option<(usize, &[usize])> {
        let mut offset = 0;
        for slot in &self.slots {
            if slot.id == id {
                return Some((offset, &slot.shape));
            }
            offset += slot.len();
        }
        None
    }

    /// Each parameter's range of the flat vector, in visiting order.
    pub fn spans(&self) -> Vec<std::ops::Range<usize>> {
        let mut offset = 0;
        (self.slots.iter())
            .map(|slot| {
                offset += slot.len();
                offset - slot.len()..offset
            })
            .collect()
    }

    /// The float type the updated weights travel in: the parameters' own type when they all
    /// share one (writing back then casts nothing), f32 otherwise.
    pub fn wire_dtype(&self) -> DType {
        match self.slots.first() {
            Some(first) if self.slots.iter().all(|s| s.dtype == first.dtype) => first.dtype,
            _ => DType::F32,
        }
    }

    /// FNV-1a over the parameters' shapes and float types (ids excluded: they differ between
    /// processes): the same on every rank whose model has the same structure.
    pub fn fingerprint(&self) -> u64 {
        let bytes = self.slots.iter().flat_map(|s| {
            let dims = s.shape.iter().flat_map(|&d| (d as u64).to_le_bytes());
            let head = format!("{:?}:{}", s.dtype, s.shape.len()).into_bytes();
            head.into_iter().chain(dims).collect::<Vec<u8>>()
        });
        bytes.fold(0xcbf2_9ce4_8422_2325, |hash, byte| {
            (hash ^ u64::from(byte)).wrapping_mul(0x0100_0000_01b3)
        })
    }

    /// A one-line description: `"26 tensors, 102400 elements, fingerprint 0x..."`.
    pub fn describe(&self) -> String {
        format!(
            "{} tensors, {} elements, layout fingerprint {:#018x}",
            self.num_tensors(),
            self.len,
            self.fingerprint()
        )
    }

    /// Every parameter's value as one f32 vector `[padded]` (zeros for the padding).
    pub fn weights<B: AutodiffBackend, M: Module<B>>(
        &self,
        model: &M,
    ) -> Tensor<B::InnerBackend, 1> {
        FlatPieces::weights::<B, M>(model).range(0..self.padded)
    }

    /// `model` with every parameter replaced by its elements of `flat` (`[padded]`, any float
    /// type), cast to the parameter's float type; parameters that required gradients still do.
    pub fn write_back<B: AutodiffBackend, M: Module<B>>(
        &self,
        model: M,
        flat: Tensor<B::InnerBackend, 1>,
    ) -> M {
        model.map(&mut WriteBack { flat, offset: 0 })
    }
}

/// Collects the parameters' slots in visiting order.
struct Slots(Vec<Slot>);

impl<B: AutodiffBackend> ModuleVisitor<B> for Slots {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        let value = param.val();
        self.0.push(Slot {
            id: param.id,
            shape: value.dims().to_vec(),
            dtype: value.dtype(),
        });
    }
}

/// Replaces each parameter by its elements of `flat`, in visiting order.
struct WriteBack<I: burn::tensor::backend::Backend> {
    flat: Tensor<I, 1>,
    offset: usize,
}

impl<B: AutodiffBackend> ModuleMapper<B> for WriteBack<B::InnerBackend> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let (id, old, mapper) = param.consume();
        let (shape, dtype) = (old.shape(), old.dtype());
        let len = shape.num_elements();
        let value = (self.flat.clone().narrow(0, self.offset, len))
            .reshape(shape)
            .cast(dtype);
        self.offset += len;
        let mut new = Tensor::<B, D>::from_inner(value);
        if old.is_require_grad() {
            new = new.require_grad();
        }
        Param::from_mapped_value(id, new, mapper)
    }
}
