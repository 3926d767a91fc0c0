//! Reading a `trainer.json` written before some of [`TrainOptions`]' fields existed: Burn's
//! `Config` deserialisation requires every field, so each defaulted field the file lacks (the ZeRO
//! stage, the loss and feed-forward chunks, the optimizer state's placement, the gradient sum's
//! bucket size) is filled with its default before the file is read.

use burn::config::config_to_json;
use serde_json::{Map, Value};

use super::TrainOptions;

/// `state` (a `trainer.json`'s text) with its `options` completed by the defaults of the fields
/// it lacks; `state` itself where its options lack a required field (`steps`, `batch`,
/// `seq_len`: reading it then names the field) or it is not JSON (likewise).
pub(super) fn with_option_defaults(state: &str) -> String {
    let Ok(mut value) = serde_json::from_str::<Value>(state) else {
        return state.to_string();
    };
    let Some(options) = value.get_mut("options").and_then(Value::as_object_mut) else {
        return state.to_string();
    };
    let Some(defaults) = defaults_for(options) else {
        return state.to_string();
    };
    for (field, default) in defaults {
        options.entry(field).or_insert(default);
    }
    value.to_string()
}

/// Every field of the options with `options`' required fields and the others' defaults.
fn defaults_for(options: &Map<String, Value>) -> Option<Map<String, Value>> {
    let number = |field: &str| options.get(field)?.as_u64();
    let (steps, batch, seq_len) = (number("steps")?, number("batch")?, number("seq_len")?);
    let defaults = TrainOptions::new(steps, batch as usize, seq_len as usize);
    match serde_json::from_str(&config_to_json(&defaults)) {
        Ok(Value::Object(fields)) => Some(fields),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::optimizer::{StatePlacement, ZeroStage};
    use crate::train::TrainerState;
    use burn::config::Config;

    #[test]
    fn options_written_before_the_stage_and_the_chunks_read_back_with_their_defaults() {
        let old = r#"{"step":7,"options":{"steps":50,"batch":2,"seq_len":64,"lr":0.002,
            "min_lr_ratio":0.1,"warmup":3,"weight_decay":0.1,"beta_1":0.9,"beta_2":0.95,
            "grad_clip":1.0,"seed":4},"optimizer_shards":null}"#;
        assert!(
            TrainerState::load_binary(old.as_bytes()).is_err(),
            "Burn needs every field"
        );
        let state = TrainerState::load_binary(with_option_defaults(old).as_bytes()).unwrap();
        let defaults = TrainOptions::new(50, 2, 64);
        assert_eq!(
            (state.step, state.options.lr, state.options.seed),
            (7, 0.002, 4)
        );
        assert_eq!(state.options.zero, ZeroStage::Replicated);
        assert_eq!(state.options.loss_chunks, defaults.loss_chunks);
        assert_eq!(state.options.ffn_chunks, defaults.ffn_chunks);
        assert_eq!(state.options.optimizer_state, StatePlacement::Gpu);
        assert_eq!(state.options.state_chunk_bytes, defaults.state_chunk_bytes);
        assert_eq!(state.options.grad_bucket_bytes, 256 << 20);
    }

    #[test]
    fn written_fields_are_kept_and_unreadable_files_are_left_to_the_reader() {
        let options = (TrainOptions::new(5, 1, 8).with_zero(ZeroStage::Gradients))
            .with_optimizer_state(StatePlacement::Host)
            .with_state_chunk_bytes(1 << 20)
            .with_grad_bucket_bytes(3 << 20);
        let state = TrainerState::new(3, options).with_optimizer_shards(Some(2));
        let json = config_to_json(&state);
        let read = TrainerState::load_binary(with_option_defaults(&json).as_bytes()).unwrap();
        assert_eq!(read.options.zero, ZeroStage::Gradients);
        assert_eq!(read.options.optimizer_state, StatePlacement::Host);
        assert_eq!(read.options.state_chunk_bytes, 1 << 20);
        assert_eq!(read.options.grad_bucket_bytes, 3 << 20);
        assert_eq!(read.optimizer_shards, Some(2));
        for text in ["not json", r#"{"step":1}"#, r#"{"options":{"batch":1}}"#] {
            assert_eq!(with_option_defaults(text), text);
        }
    }
}
