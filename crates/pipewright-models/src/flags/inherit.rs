//! What a resumed run takes from the run it resumes when its flags do not say: the
//! checkpointing cadence its run directory recorded.

use pipewright::experiment::Params;
use pipewright::Result;

/// A resume (`--resume`) without `--checkpoint-every` goes on checkpointing as its run did:
/// the interval (and `--keep`, unless given) that the run directory's `parameters.json`
/// recorded; returns the note to say once (on the first rank) where it did. Without this a
/// resume stopped checkpointing and recorded 0, so the next resume started from the step
/// before it.
pub fn inherit_checkpointing(params: &mut Params) -> Result<Option<String>> {
    let (Some(_), Some(out)) = (params.string("checkpoint")?, params.string("out")?) else {
        return Ok(None);
    };
    if params.int("checkpoint_every")? != 0 {
        return Ok(None);
    }
    let recorded = std::fs::read_to_string(std::path::Path::new(&out).join("parameters.json"))
        .ok()
        .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok());
    let Some(old) = recorded else { return Ok(None) };
    let Some(every) = old["checkpoint_every"].as_u64().filter(|&n| n > 0) else {
        return Ok(None);
    };
    params.set("checkpoint_every", every.into())?;
    let mut keep = String::new();
    if params.to_json()["keep"].is_null() {
        if let Some(k) = old["keep"].as_u64() {
            params.set("keep", k.into())?;
            keep = format!(", keeping the newest {k}");
        }
    }
    Ok(Some(format!(
        "checkpointing every {every} steps{keep}, as the run did (its parameters.json); \
         --checkpoint-every changes it"
    )))
}
