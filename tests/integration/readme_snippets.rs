//! The README's snippet of adding attention and checkpointing to a model compiles: it is this
//! file's code between the snippet markers, and a test checks that the README holds it verbatim,
//! so neither changes without the other. (Compiled, not run: the snippet builds a LLaMA-7B-sized
//! block on CUDA.)

// README snippet: begin
use burn_distflash::layers::{CheckpointPlacement, TransformerBlockConfig};
use burn_distflash::{AttentionContext, AttentionInput, DistFlashAttentionConfig, Documents};
// README snippet: end

use burn::backend::Autodiff;
use burn::tensor::Tensor;
use burn_distflash::DeviceGroup;
use cubecl::cuda::CudaDevice;

type Cuda = burn_cubecl::CubeBackend<cubecl::cuda::CudaRuntime, f32, i32, u8>;

/// The snippet, with its free names as arguments: the device, the whole sequence's hidden
/// states, this rank's shard of them and its group.
#[allow(dead_code, unused_variables)]
fn add_a_block_to_a_model(
    device: CudaDevice,
    x: Tensor<Autodiff<Cuda>, 3>,
    x_shard: Tensor<Autodiff<Cuda>, 3>,
    group: DeviceGroup<Cuda>,
) -> Result<(), Box<dyn std::error::Error>> {
    // README snippet: begin
    let block = TransformerBlockConfig::new(DistFlashAttentionConfig::new(4096, 32), 11008)
        .with_checkpoint(CheckpointPlacement::AttentionOutput) // or Layer, or None
        .init::<Autodiff<Cuda>>(&device);
    // The whole sequence on this device:
    let y = block.forward(x.clone(), &AttentionContext::Local);
    // Rows that pack documents (here 100, 28 and 128 tokens): tokens attend within their own.
    let documents = Documents::from_cu_seqlens(&[0, 100, 128, 256])?;
    let y = block.try_forward(
        AttentionInput::new(x).documents(documents),
        &AttentionContext::Local,
    )?;
    // Or this rank's shard of a sequence split across a DeviceGroup (see below):
    let y = block.forward(x_shard, &AttentionContext::sharded(group));
    // README snippet: end
    Ok(())
}

/// The code between this file's snippet markers, each region's lines without the indentation
/// of its first line, the regions separated by an empty line.
fn marked_regions(source: &str) -> String {
    let mut regions: Vec<Vec<&str>> = Vec::new();
    let mut inside = false;
    for line in source.lines() {
        match line.trim() {
            "// README snippet: begin" => {
                inside = true;
                regions.push(Vec::new());
            }
            "// README snippet: end" => inside = false,
            _ if inside => regions.last_mut().expect("a region").push(line),
            _ => {}
        }
    }
    let dedent = |lines: &Vec<&str>| {
        let indent = lines[0].len() - lines[0].trim_start().len();
        lines
            .iter()
            .map(|l| l.get(indent..).unwrap_or("").to_string())
            .collect::<Vec<_>>()
    };
    (regions.iter().map(|r| dedent(r).join("\n")))
        .collect::<Vec<_>>()
        .join("\n\n")
}

#[test]
fn the_readme_shows_the_compiled_snippet_verbatim() {
    let readme = include_str!("../../README.md");
    let snippet = marked_regions(include_str!("readme_snippets.rs"));
    assert!(
        readme.contains(&format!("```rust\n{snippet}\n```")),
        "the README's snippet of adding a block to a model is not this test's code:\n{snippet}"
    );
}
