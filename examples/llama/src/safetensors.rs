//! Reading and writing the Hugging Face safetensors format.
//!
//! A safetensors file is an 8-byte little-endian header length `n`, then `n` bytes of JSON that
//! map each tensor name to `{"dtype", "shape", "data_offsets": [begin, end]}` (byte offsets
//! relative to the end of the header), plus an optional `"__metadata__"` map of strings, then
//! the raw little-endian tensor data. This module reads F32, F16 and BF16 tensors into `f32`
//! values and writes them back in the dtype each tensor records.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::fs::{self, File};
use std::io::{self, BufWriter, Read, Seek, SeekFrom, Write};
use std::path::{Component, Path, PathBuf};

use half::{bf16, f16};
use serde::Deserialize;
use serde_json::Value;

/// Largest JSON header accepted, in bytes (the limit of the reference implementation).
pub const MAX_HEADER_LEN: u64 = 100 * 1024 * 1024;

/// File name of a single-file checkpoint inside a model directory.
pub const SINGLE_FILE_NAME: &str = "model.safetensors";

/// File name of the shard index of a sharded checkpoint inside a model directory.
pub const INDEX_FILE_NAME: &str = "model.safetensors.index.json";

/// Header key reserved for the string-to-string metadata map.
const METADATA_KEY: &str = "__metadata__";

/// Element type of a tensor as stored on disk.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SafeDType {
    /// IEEE 754 single precision (4 bytes).
    F32,
    /// IEEE 754 half precision (2 bytes).
    F16,
    /// bfloat16: the upper half of an `f32` (2 bytes).
    BF16,
}

impl SafeDType {
    /// Size of one element in bytes.
    pub fn size_in_bytes(self) -> usize {
        match self {
            SafeDType::F32 => 4,
            SafeDType::F16 | SafeDType::BF16 => 2,
        }
    }

    /// The dtype's name in a safetensors header (`"F32"`, `"F16"` or `"BF16"`).
    pub fn name(self) -> &'static str {
        match self {
            SafeDType::F32 => "F32",
            SafeDType::F16 => "F16",
            SafeDType::BF16 => "BF16",
        }
    }

    /// Parses a header dtype name; `None` for dtypes this module does not support.
    pub fn from_name(name: &str) -> Option<Self> {
        match name {
            "F32" => Some(SafeDType::F32),
            "F16" => Some(SafeDType::F16),
            "BF16" => Some(SafeDType::BF16),
            _ => None,
        }
    }

    fn decode(self, bytes: &[u8]) -> Vec<f32> {
        match self {
            SafeDType::F32 => bytes
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect(),
            SafeDType::F16 => bytes
                .chunks_exact(2)
                .map(|b| f16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
            SafeDType::BF16 => bytes
                .chunks_exact(2)
                .map(|b| bf16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
        }
    }

    fn encode(self, values: &[f32]) -> Vec<u8> {
        let mut out = Vec::with_capacity(values.len() * self.size_in_bytes());
        for &v in values {
            match self {
                SafeDType::F32 => out.extend_from_slice(&v.to_le_bytes()),
                SafeDType::F16 => out.extend_from_slice(&f16::from_f32(v).to_le_bytes()),
                SafeDType::BF16 => out.extend_from_slice(&bf16::from_f32(v).to_le_bytes()),
            }
        }
        out
    }
}

impl fmt::Display for SafeDType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// One tensor: its shape, its dtype on disk and its values widened to `f32` (row-major).
#[derive(Debug, Clone, PartialEq)]
pub struct SafeTensor {
    /// Dimensions, outermost first; empty for a scalar.
    pub shape: Vec<usize>,
    /// Element type on disk: the type read from, or the type written to.
    pub dtype: SafeDType,
    /// Values in row-major order; `data.len()` equals the product of `shape`.
    pub data: Vec<f32>,
}

impl SafeTensor {
    /// Creates a tensor, checking that `data` has exactly as many values as `shape` describes.
    pub fn new(
        shape: Vec<usize>,
        dtype: SafeDType,
        data: Vec<f32>,
    ) -> Result<Self, SafeTensorsError> {
        if element_count(&shape) != Some(data.len()) {
            return Err(SafeTensorsError::ElementCount {
                tensor: None,
                shape,
                values: data.len(),
            });
        }
        Ok(Self { shape, dtype, data })
    }
}

/// Everything that can go wrong reading or writing safetensors files.
#[derive(Debug)]
pub enum SafeTensorsError {
    /// Opening, reading or writing a file failed.
    Io {
        /// The file involved.
        path: PathBuf,
        /// The underlying error.
        source: io::Error,
    },
    /// The file's length prefix or JSON header is not valid safetensors.
    InvalidHeader {
        /// The file involved.
        path: PathBuf,
        /// What was wrong.
        reason: String,
    },
    /// One tensor's header entry is invalid (bad offsets, size mismatch, overlap, bad name).
    InvalidTensor {
        /// The file involved.
        path: PathBuf,
        /// The tensor's name.
        tensor: String,
        /// What was wrong.
        reason: String,
    },
    /// A tensor is stored in a dtype other than F32, F16 or BF16.
    UnsupportedDType {
        /// The file involved.
        path: PathBuf,
        /// The tensor's name.
        tensor: String,
        /// The dtype named in the header.
        dtype: String,
    },
    /// A tensor's number of values differs from the product of its shape.
    ElementCount {
        /// The tensor's name, when known.
        tensor: Option<String>,
        /// The tensor's shape.
        shape: Vec<usize>,
        /// The number of values it holds.
        values: usize,
    },
    /// A model directory holds neither `model.safetensors` nor `model.safetensors.index.json`.
    NoModelFiles {
        /// The directory searched.
        dir: PathBuf,
    },
    /// The shard index `model.safetensors.index.json` is invalid or disagrees with the shards.
    InvalidIndex {
        /// The index file.
        path: PathBuf,
        /// What was wrong.
        reason: String,
    },
    /// Two shards of one checkpoint contain a tensor of the same name.
    DuplicateTensor {
        /// The tensor's name.
        tensor: String,
        /// The shard read first.
        first: PathBuf,
        /// The shard that repeats it.
        second: PathBuf,
    },
}

impl fmt::Display for SafeTensorsError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Io { path, source } => write!(f, "I/O error on {}: {source}", path.display()),
            Self::InvalidHeader { path, reason } => {
                write!(
                    f,
                    "{} is not a valid safetensors file: {reason}",
                    path.display()
                )
            }
            Self::InvalidTensor {
                path,
                tensor,
                reason,
            } => write!(f, "tensor `{tensor}` in {}: {reason}", path.display()),
            Self::UnsupportedDType {
                path,
                tensor,
                dtype,
            } => write!(
                f,
                "tensor `{tensor}` in {} has dtype `{dtype}`; only F32, F16 and BF16 are supported",
                path.display()
            ),
            Self::ElementCount {
                tensor,
                shape,
                values,
            } => {
                match tensor {
                    Some(name) => write!(f, "tensor `{name}` ")?,
                    None => f.write_str("tensor ")?,
                }
                match element_count(shape) {
                    Some(n) => write!(
                        f,
                        "has shape {shape:?} ({n} elements) but {values} values; the number of \
                         values must equal the product of the shape"
                    ),
                    None => write!(
                        f,
                        "has shape {shape:?} whose element count overflows usize ({values} values \
                         given)"
                    ),
                }
            }
            Self::NoModelFiles { dir } => write!(
                f,
                "{} contains neither {SINGLE_FILE_NAME} nor {INDEX_FILE_NAME}",
                dir.display()
            ),
            Self::InvalidIndex { path, reason } => {
                write!(f, "invalid shard index {}: {reason}", path.display())
            }
            Self::DuplicateTensor {
                tensor,
                first,
                second,
            } => write!(
                f,
                "tensor `{tensor}` appears in both {} and {}; each tensor must be in one shard",
                first.display(),
                second.display()
            ),
        }
    }
}

impl std::error::Error for SafeTensorsError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Self::Io { source, .. } => Some(source),
            _ => None,
        }
    }
}

/// Product of the dimensions, `None` on overflow.
fn element_count(shape: &[usize]) -> Option<usize> {
    shape.iter().try_fold(1usize, |acc, &d| acc.checked_mul(d))
}

/// A tensor entry of a header, validated against the data section's length.
struct Entry {
    name: String,
    dtype: SafeDType,
    shape: Vec<usize>,
    begin: u64,
    end: u64,
}

#[derive(Deserialize)]
struct RawEntry {
    dtype: String,
    shape: Vec<usize>,
    data_offsets: (u64, u64),
}

fn parse_entry(
    path: &Path,
    name: &str,
    value: &Value,
    data_len: u64,
) -> Result<Entry, SafeTensorsError> {
    let invalid = |reason: String| SafeTensorsError::InvalidTensor {
        path: path.to_path_buf(),
        tensor: name.to_string(),
        reason,
    };
    let raw = RawEntry::deserialize(value).map_err(|e| {
        invalid(format!(
            "header entry must be {{\"dtype\": string, \"shape\": [non-negative integers], \
             \"data_offsets\": [begin, end]}}: {e}"
        ))
    })?;
    let dtype =
        SafeDType::from_name(&raw.dtype).ok_or_else(|| SafeTensorsError::UnsupportedDType {
            path: path.to_path_buf(),
            tensor: name.to_string(),
            dtype: raw.dtype.clone(),
        })?;
    let (begin, end) = raw.data_offsets;
    if begin > end {
        return Err(invalid(format!(
            "data_offsets [{begin}, {end}] are reversed; begin must not exceed end"
        )));
    }
    if end > data_len {
        return Err(invalid(format!(
            "data_offsets [{begin}, {end}] run past the end of the data section ({data_len} \
             bytes); the file may be truncated"
        )));
    }
    let expected = element_count(&raw.shape)
        .and_then(|n| n.checked_mul(dtype.size_in_bytes()))
        .and_then(|n| u64::try_from(n).ok());
    if expected != Some(end - begin) {
        let expected = expected.map_or_else(|| "more than u64::MAX".to_string(), |n| n.to_string());
        return Err(invalid(format!(
            "shape {:?} in {dtype} needs {expected} bytes but data_offsets [{begin}, {end}] \
             span {} bytes",
            raw.shape,
            end - begin
        )));
    }
    Ok(Entry {
        name: name.to_string(),
        dtype,
        shape: raw.shape,
        begin,
        end,
    })
}

/// Reads every tensor of one safetensors file, converting F16 and BF16 values to `f32`.
///
/// The header is validated against the file: the length prefix must fit in the file, every
/// entry needs a supported dtype and offsets inside the data section that match its shape, and
/// no two tensors may share bytes. The `"__metadata__"` entry, if any, must map strings to
/// strings; its contents are not returned.
pub fn read_safetensors(path: &Path) -> Result<BTreeMap<String, SafeTensor>, SafeTensorsError> {
    let io_err = |source| SafeTensorsError::Io {
        path: path.to_path_buf(),
        source,
    };
    let header_err = |reason: String| SafeTensorsError::InvalidHeader {
        path: path.to_path_buf(),
        reason,
    };
    let mut file = File::open(path).map_err(io_err)?;
    let file_len = file.metadata().map_err(io_err)?.len();
    if file_len < 8 {
        return Err(header_err(format!(
            "the file is {file_len} bytes long, shorter than the 8-byte header length prefix"
        )));
    }
    let mut prefix = [0u8; 8];
    file.read_exact(&mut prefix).map_err(io_err)?;
    let header_len = u64::from_le_bytes(prefix);
    if header_len > file_len - 8 {
        return Err(header_err(format!(
            "the header length prefix says {header_len} bytes but only {} bytes follow it; the \
             file is truncated or not safetensors",
            file_len - 8
        )));
    }
    if header_len > MAX_HEADER_LEN {
        return Err(header_err(format!(
            "the header is {header_len} bytes; at most {MAX_HEADER_LEN} bytes are allowed"
        )));
    }
    // Bounded by the file length and MAX_HEADER_LEN, so the cast and allocation are safe.
    let mut header = vec![0u8; header_len as usize];
    file.read_exact(&mut header).map_err(io_err)?;
    let header: Value = serde_json::from_slice(&header)
        .map_err(|e| header_err(format!("the header is not valid JSON: {e}")))?;
    let Value::Object(header) = header else {
        return Err(header_err(
            "the header must be a JSON object mapping tensor names to entries".to_string(),
        ));
    };
    let data_start = 8 + header_len;
    let data_len = file_len - data_start;

    let mut entries = Vec::with_capacity(header.len());
    for (name, value) in &header {
        if name == METADATA_KEY {
            let valid = value
                .as_object()
                .is_some_and(|m| m.values().all(Value::is_string));
            if !valid {
                return Err(header_err(format!(
                    "`{METADATA_KEY}` must be an object whose values are strings"
                )));
            }
            continue;
        }
        entries.push(parse_entry(path, name, value, data_len)?);
    }

    entries.sort_by_key(|e| (e.begin, e.end));
    for pair in entries.windows(2) {
        if pair[1].begin < pair[0].end {
            return Err(SafeTensorsError::InvalidTensor {
                path: path.to_path_buf(),
                tensor: pair[1].name.clone(),
                reason: format!(
                    "its bytes [{}, {}) overlap those of tensor `{}` [{}, {}); tensors must not \
                     share bytes",
                    pair[1].begin, pair[1].end, pair[0].name, pair[0].begin, pair[0].end
                ),
            });
        }
    }

    let mut tensors = BTreeMap::new();
    for entry in entries {
        // `end - begin` is at most the file length, already read as a u64 from metadata.
        let mut bytes = vec![0u8; (entry.end - entry.begin) as usize];
        file.seek(SeekFrom::Start(data_start + entry.begin))
            .map_err(io_err)?;
        file.read_exact(&mut bytes).map_err(io_err)?;
        let data = entry.dtype.decode(&bytes);
        tensors.insert(
            entry.name,
            SafeTensor {
                shape: entry.shape,
                dtype: entry.dtype,
                data,
            },
        );
    }
    Ok(tensors)
}

#[derive(Deserialize)]
struct ShardIndex {
    weight_map: BTreeMap<String, String>,
}

/// Reads a Hugging Face model directory's weights into one map.
///
/// Reads `model.safetensors` when it exists (as `transformers` does), otherwise every shard that
/// `model.safetensors.index.json` lists in its `weight_map`. Shard names must be plain file names
/// inside `dir`; every tensor the index lists must be in the shard it names, and no tensor may
/// appear in two shards. Tensors present in a shard but absent from the index are kept.
pub fn read_safetensors_dir(dir: &Path) -> Result<BTreeMap<String, SafeTensor>, SafeTensorsError> {
    let single = dir.join(SINGLE_FILE_NAME);
    if single.is_file() {
        return read_safetensors(&single);
    }
    let index_path = dir.join(INDEX_FILE_NAME);
    if !index_path.is_file() {
        return Err(SafeTensorsError::NoModelFiles {
            dir: dir.to_path_buf(),
        });
    }
    let index_err = |reason: String| SafeTensorsError::InvalidIndex {
        path: index_path.clone(),
        reason,
    };
    let text = fs::read_to_string(&index_path).map_err(|source| SafeTensorsError::Io {
        path: index_path.clone(),
        source,
    })?;
    let index: ShardIndex = serde_json::from_str(&text).map_err(|e| {
        index_err(format!(
            "expected {{\"weight_map\": {{tensor name: shard file name}}}}: {e}"
        ))
    })?;
    if index.weight_map.is_empty() {
        return Err(index_err("`weight_map` is empty".to_string()));
    }
    let shards: BTreeSet<&String> = index.weight_map.values().collect();
    for shard in &shards {
        let mut components = Path::new(shard.as_str()).components();
        let plain = matches!(
            (components.next(), components.next()),
            (Some(Component::Normal(_)), None)
        );
        if !plain {
            return Err(index_err(format!(
                "shard `{shard}` is not a plain file name; shards must lie in the model directory"
            )));
        }
    }

    let mut tensors = BTreeMap::new();
    let mut origin: BTreeMap<String, PathBuf> = BTreeMap::new();
    for shard in shards {
        let shard_path = dir.join(shard);
        for (name, tensor) in read_safetensors(&shard_path)? {
            if let Some(first) = origin.get(&name) {
                return Err(SafeTensorsError::DuplicateTensor {
                    tensor: name,
                    first: first.clone(),
                    second: shard_path,
                });
            }
            origin.insert(name.clone(), shard_path.clone());
            tensors.insert(name, tensor);
        }
    }
    for (name, shard) in &index.weight_map {
        if origin.get(name) != Some(&dir.join(shard)) {
            return Err(index_err(format!(
                "tensor `{name}` is listed in shard `{shard}`, but that shard does not contain it"
            )));
        }
    }
    Ok(tensors)
}

/// Writes tensors to one safetensors file, each in the dtype its [`SafeTensor`] records.
///
/// F32 values round-trip exactly; F16 and BF16 values are rounded to nearest-even on write
/// (values beyond the F16 range become infinities). The header carries
/// `"__metadata__": {"format": "pt"}`, which `transformers` expects, and is padded with spaces to
/// a multiple of 8 bytes; tensors are laid out largest dtype first so every tensor is aligned to
/// its element size. The file is written to a temporary sibling and renamed into place, so an
/// interrupted write never leaves a partial file under `path`.
pub fn write_safetensors(
    path: &Path,
    tensors: &BTreeMap<String, SafeTensor>,
) -> Result<(), SafeTensorsError> {
    let mut order: Vec<(&String, &SafeTensor)> = tensors.iter().collect();
    for (name, tensor) in &order {
        if name.as_str() == METADATA_KEY {
            return Err(SafeTensorsError::InvalidTensor {
                path: path.to_path_buf(),
                tensor: name.to_string(),
                reason: format!("the name `{METADATA_KEY}` is reserved for file metadata"),
            });
        }
        if element_count(&tensor.shape) != Some(tensor.data.len()) {
            return Err(SafeTensorsError::ElementCount {
                tensor: Some(name.to_string()),
                shape: tensor.shape.clone(),
                values: tensor.data.len(),
            });
        }
    }
    order.sort_by(|a, b| {
        b.1.dtype
            .size_in_bytes()
            .cmp(&a.1.dtype.size_in_bytes())
            .then_with(|| a.0.cmp(b.0))
    });

    let mut header = serde_json::Map::new();
    header.insert(
        METADATA_KEY.to_string(),
        serde_json::json!({ "format": "pt" }),
    );
    let mut offset = 0u64;
    for (name, tensor) in &order {
        let bytes = (tensor.data.len() * tensor.dtype.size_in_bytes()) as u64;
        header.insert(
            name.to_string(),
            serde_json::json!({
                "dtype": tensor.dtype.name(),
                "shape": tensor.shape,
                "data_offsets": [offset, offset + bytes],
            }),
        );
        offset += bytes;
    }
    let mut header = serde_json::to_vec(&Value::Object(header)).map_err(|e| {
        SafeTensorsError::InvalidHeader {
            path: path.to_path_buf(),
            reason: format!("could not serialize the header: {e}"),
        }
    })?;
    while header.len() % 8 != 0 {
        header.push(b' ');
    }

    let file_name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let tmp_path = path.with_file_name(format!(".{file_name}.tmp"));
    let write = || -> io::Result<()> {
        let mut out = BufWriter::new(File::create(&tmp_path)?);
        out.write_all(&(header.len() as u64).to_le_bytes())?;
        out.write_all(&header)?;
        for (_, tensor) in &order {
            out.write_all(&tensor.dtype.encode(&tensor.data))?;
        }
        out.into_inner().map_err(|e| e.into_error())?.sync_all()?;
        fs::rename(&tmp_path, path)
    };
    write().map_err(|source| {
        // Best effort: the temporary file may not exist if creating it failed.
        let _ = fs::remove_file(&tmp_path);
        SafeTensorsError::Io {
            path: path.to_path_buf(),
            source,
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::temp_dir::TempDir;

    /// Builds a safetensors file by hand, independently of `write_safetensors`.
    fn raw_file(header: &str, data: &[u8]) -> Vec<u8> {
        let mut out = (header.len() as u64).to_le_bytes().to_vec();
        out.extend_from_slice(header.as_bytes());
        out.extend_from_slice(data);
        out
    }

    fn tensor(shape: &[usize], dtype: SafeDType, data: &[f32]) -> SafeTensor {
        SafeTensor::new(shape.to_vec(), dtype, data.to_vec()).expect("valid tensor")
    }

    #[test]
    fn f32_round_trip_is_bit_exact() {
        let tmp = TempDir::new("f32");
        let path = tmp.path().join("w.safetensors");
        let values = [1.5, -2.25, 3.1e-5, 1e30, f32::MIN_POSITIVE / 4.0, -0.0];
        let mut map = BTreeMap::new();
        map.insert(
            "a.weight".to_string(),
            tensor(&[2, 3], SafeDType::F32, &values),
        );
        map.insert("scalar".to_string(), tensor(&[], SafeDType::F32, &[7.0]));
        map.insert("empty".to_string(), tensor(&[0, 4], SafeDType::F32, &[]));
        write_safetensors(&path, &map).unwrap();
        let back = read_safetensors(&path).unwrap();
        assert_eq!(back.len(), 3);
        let bits = |t: &SafeTensor| t.data.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        for (name, t) in &map {
            assert_eq!(back[name].shape, t.shape);
            assert_eq!(back[name].dtype, SafeDType::F32);
            assert_eq!(bits(&back[name]), bits(t), "{name}");
        }
    }

    #[test]
    fn f16_and_bf16_round_trip_rounds_to_nearest() {
        let tmp = TempDir::new("half");
        let path = tmp.path().join("w.safetensors");
        let mut map = BTreeMap::new();
        map.insert(
            "h".to_string(),
            tensor(&[4], SafeDType::F16, &[0.5, -1.25, 1024.0, 0.1]),
        );
        map.insert(
            "b".to_string(),
            tensor(&[2, 2], SafeDType::BF16, &[0.5, -3.0, 256.0, 0.1]),
        );
        map.insert("f".to_string(), tensor(&[1], SafeDType::F32, &[0.1]));
        write_safetensors(&path, &map).unwrap();
        let back = read_safetensors(&path).unwrap();
        // The nearest f16 to 0.1 is 0x2E66 (0.0999755859375); the nearest bf16 is 0x3DCD
        // (0.10009765625), one step above 0x3DCC because 0.1 is 0x3DCC_CCCD in f32.
        let (h01, b01) = (
            f16::from_bits(0x2E66).to_f32(),
            bf16::from_bits(0x3DCD).to_f32(),
        );
        assert_eq!(back["h"].dtype, SafeDType::F16);
        assert_eq!(back["h"].data, vec![0.5, -1.25, 1024.0, h01]);
        assert_eq!(back["b"].dtype, SafeDType::BF16);
        assert_eq!(back["b"].shape, vec![2, 2]);
        assert_eq!(back["b"].data, vec![0.5, -3.0, 256.0, b01]);
        assert_eq!(back["f"].data, vec![0.1]);
    }

    #[test]
    fn written_layout_is_aligned_and_complete() {
        let tmp = TempDir::new("layout");
        let path = tmp.path().join("w.safetensors");
        let mut map = BTreeMap::new();
        map.insert(
            "a".to_string(),
            tensor(&[3], SafeDType::BF16, &[1.0, 2.0, 3.0]),
        );
        map.insert("z".to_string(), tensor(&[2], SafeDType::F32, &[1.0, 2.0]));
        write_safetensors(&path, &map).unwrap();
        let bytes = fs::read(&path).unwrap();
        let header_len = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
        assert_eq!(header_len % 8, 0);
        assert_eq!(bytes.len(), 8 + header_len + 3 * 2 + 2 * 4);
        let header: Value = serde_json::from_slice(&bytes[8..8 + header_len]).unwrap();
        assert_eq!(header["__metadata__"]["format"], "pt");
        // The 4-byte tensor comes first so both stay aligned to their element size.
        assert_eq!(header["z"]["data_offsets"], serde_json::json!([0, 8]));
        assert_eq!(header["a"]["data_offsets"], serde_json::json!([8, 14]));
        assert_eq!(header["a"]["dtype"], "BF16");
        assert!(!tmp.path().join(".w.safetensors.tmp").exists());
    }

    #[test]
    fn reads_hand_built_half_precision_file() {
        let tmp = TempDir::new("hand");
        let path = tmp.path().join("h.safetensors");
        let header = r#"{"__metadata__":{"format":"pt"},"x":{"dtype":"F16","shape":[2],"data_offsets":[0,4]},"y":{"dtype":"BF16","shape":[1,1],"data_offsets":[4,6]}}"#;
        // f16 1.0 = 0x3C00, f16 -2.0 = 0xC000, bf16 1.0 = 0x3F80 (little-endian on disk).
        fs::write(
            &path,
            raw_file(header, &[0x00, 0x3C, 0x00, 0xC0, 0x80, 0x3F]),
        )
        .unwrap();
        let t = read_safetensors(&path).unwrap();
        assert_eq!(t["x"].data, vec![1.0, -2.0]);
        assert_eq!(t["y"].data, vec![1.0]);
        assert_eq!(t["y"].shape, vec![1, 1]);
    }

    #[test]
    fn reads_shards_listed_in_an_index() {
        let tmp = TempDir::new("shards");
        let mut first = BTreeMap::new();
        first.insert(
            "embed".to_string(),
            tensor(&[2], SafeDType::F32, &[1.0, 2.0]),
        );
        let mut second = BTreeMap::new();
        second.insert("head".to_string(), tensor(&[1], SafeDType::BF16, &[4.0]));
        write_safetensors(&tmp.path().join("model-00001-of-00002.safetensors"), &first).unwrap();
        write_safetensors(
            &tmp.path().join("model-00002-of-00002.safetensors"),
            &second,
        )
        .unwrap();
        let index = r#"{"metadata":{"total_size":10},"weight_map":{
            "embed":"model-00001-of-00002.safetensors","head":"model-00002-of-00002.safetensors"}}"#;
        fs::write(tmp.path().join(INDEX_FILE_NAME), index).unwrap();
        let all = read_safetensors_dir(tmp.path()).unwrap();
        assert_eq!(all.keys().collect::<Vec<_>>(), ["embed", "head"]);
        assert_eq!(all["embed"].data, vec![1.0, 2.0]);
        assert_eq!(all["head"].data, vec![4.0]);

        // An index naming the wrong shard for a tensor is rejected.
        let wrong = r#"{"weight_map":{"embed":"model-00002-of-00002.safetensors"}}"#;
        fs::write(tmp.path().join(INDEX_FILE_NAME), wrong).unwrap();
        let err = read_safetensors_dir(tmp.path()).unwrap_err();
        assert!(
            matches!(err, SafeTensorsError::InvalidIndex { .. }),
            "{err}"
        );
        assert!(err.to_string().contains("`embed`"), "{err}");

        // Shard names that leave the directory are rejected.
        let escape = r#"{"weight_map":{"embed":"../model.safetensors"}}"#;
        fs::write(tmp.path().join(INDEX_FILE_NAME), escape).unwrap();
        let err = read_safetensors_dir(tmp.path()).unwrap_err();
        assert!(err.to_string().contains("plain file name"), "{err}");
    }

    #[test]
    fn duplicate_tensor_across_shards_is_rejected() {
        let tmp = TempDir::new("dup");
        let mut map = BTreeMap::new();
        map.insert("w".to_string(), tensor(&[1], SafeDType::F32, &[1.0]));
        write_safetensors(&tmp.path().join("a.safetensors"), &map).unwrap();
        write_safetensors(&tmp.path().join("b.safetensors"), &map).unwrap();
        let index = r#"{"weight_map":{"w":"a.safetensors","x":"b.safetensors"}}"#;
        fs::write(tmp.path().join(INDEX_FILE_NAME), index).unwrap();
        let err = read_safetensors_dir(tmp.path()).unwrap_err();
        assert!(
            matches!(err, SafeTensorsError::DuplicateTensor { ref tensor, .. } if tensor == "w")
        );
    }

    #[test]
    fn single_file_dir_and_missing_dir() {
        let tmp = TempDir::new("dir");
        let err = read_safetensors_dir(tmp.path()).unwrap_err();
        assert!(matches!(err, SafeTensorsError::NoModelFiles { .. }));
        assert!(err.to_string().contains(INDEX_FILE_NAME));
        let mut map = BTreeMap::new();
        map.insert("w".to_string(), tensor(&[1], SafeDType::F16, &[2.0]));
        write_safetensors(&tmp.path().join(SINGLE_FILE_NAME), &map).unwrap();
        assert_eq!(read_safetensors_dir(tmp.path()).unwrap(), map);
    }

    #[test]
    fn truncated_files_are_rejected() {
        let tmp = TempDir::new("trunc");
        let path = tmp.path().join("w.safetensors");
        let mut map = BTreeMap::new();
        map.insert(
            "layer.w".to_string(),
            tensor(&[4], SafeDType::F32, &[1.0; 4]),
        );
        write_safetensors(&path, &map).unwrap();
        let bytes = fs::read(&path).unwrap();

        // Data cut short: the tensor's offsets run past the end.
        fs::write(&path, &bytes[..bytes.len() - 3]).unwrap();
        let err = read_safetensors(&path).unwrap_err();
        assert!(
            matches!(err, SafeTensorsError::InvalidTensor { .. }),
            "{err}"
        );
        let msg = err.to_string();
        assert!(
            msg.contains("`layer.w`") && msg.contains("w.safetensors") && msg.contains("truncated"),
            "{msg}"
        );

        // Header cut short: the length prefix exceeds the file.
        fs::write(&path, &bytes[..20]).unwrap();
        let err = read_safetensors(&path).unwrap_err();
        assert!(
            matches!(err, SafeTensorsError::InvalidHeader { .. }),
            "{err}"
        );

        // Not even a length prefix.
        fs::write(&path, &bytes[..5]).unwrap();
        let err = read_safetensors(&path).unwrap_err();
        assert!(err.to_string().contains("5 bytes"), "{err}");

        // Missing file.
        let err = read_safetensors(&tmp.path().join("absent.safetensors")).unwrap_err();
        assert!(matches!(err, SafeTensorsError::Io { .. }));
    }

    #[test]
    fn unsupported_dtype_names_tensor_and_dtype() {
        let tmp = TempDir::new("dtype");
        let path = tmp.path().join("ints.safetensors");
        let header = r#"{"ids":{"dtype":"I64","shape":[1],"data_offsets":[0,8]}}"#;
        fs::write(&path, raw_file(header, &[0; 8])).unwrap();
        let err = read_safetensors(&path).unwrap_err();
        assert!(matches!(err, SafeTensorsError::UnsupportedDType { .. }));
        let msg = err.to_string();
        assert!(
            msg.contains("`ids`") && msg.contains("`I64`") && msg.contains("F32, F16 and BF16"),
            "{msg}"
        );
    }

    #[test]
    fn inconsistent_headers_are_rejected() {
        let tmp = TempDir::new("bad");
        let path = tmp.path().join("bad.safetensors");
        let check = |header: &str, data: &[u8], needle: &str| {
            fs::write(&path, raw_file(header, data)).unwrap();
            let msg = read_safetensors(&path).unwrap_err().to_string();
            assert!(msg.contains(needle), "expected `{needle}` in: {msg}");
        };
        check(
            r#"{"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}}"#,
            &[0; 8],
            "needs 12 bytes",
        );
        check(
            r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}"#,
            &[0; 8],
            "overlap",
        );
        check(
            r#"{"a":{"dtype":"F32","shape":[0],"data_offsets":[4,0]}}"#,
            &[0; 8],
            "reversed",
        );
        check(
            r#"{"a":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}}"#,
            &[0; 4],
            "header entry must be",
        );
        check(r#"[1, 2]"#, &[], "JSON object");
        check(r#"{"a": "#, &[], "not valid JSON");
        check(r#"{"__metadata__":{"format":1}}"#, &[], "__metadata__");
    }

    #[test]
    fn writer_rejects_bad_tensors() {
        let tmp = TempDir::new("wbad");
        let path = tmp.path().join("w.safetensors");
        let mut map = BTreeMap::new();
        map.insert(
            "w".to_string(),
            SafeTensor {
                shape: vec![2, 3],
                dtype: SafeDType::F32,
                data: vec![0.0; 5],
            },
        );
        let err = write_safetensors(&path, &map).unwrap_err();
        assert!(
            err.to_string().contains("(6 elements) but 5 values"),
            "{err}"
        );
        assert!(!path.exists());
        let mut map = BTreeMap::new();
        map.insert(
            METADATA_KEY.to_string(),
            tensor(&[1], SafeDType::F32, &[0.0]),
        );
        assert!(write_safetensors(&path, &map).is_err());
        assert!(SafeTensor::new(vec![usize::MAX, 2], SafeDType::F32, vec![]).is_err());
    }
}
