//! `serial_oracle RUN_DIR`: the losses of the run a `pipewright train` directory records
//! (its `params.json`), trained by the separate serial trainer, one per line: the oracle
//! `tools/mpi_parity.sh` holds the command's runs to.

fn main() {
    let result = (|| -> pipewright::Result<Vec<f64>> {
        let dir = std::env::args()
            .nth(1)
            .ok_or_else(|| pipewright::invalid!("usage: serial_oracle RUN_DIR"))?;
        let path = std::path::Path::new(&dir).join("params.json");
        let text = std::fs::read_to_string(&path)
            .map_err(|e| pipewright::Error::io("cannot read", &path, e))?;
        let params: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| pipewright::invalid!("{e}"))?;
        let spec: pipewright_models::RunSpec = serde_json::from_value(params["spec"].clone())
            .map_err(|e| pipewright::invalid!("{}: no run spec ({e})", path.display()))?;
        pipewright_models::parity::serial_losses(&spec)
    })();
    match result {
        Ok(losses) => {
            for l in losses {
                println!("{l}");
            }
        }
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(1);
        }
    }
}
