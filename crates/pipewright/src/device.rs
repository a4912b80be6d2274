//! Devices by name (Varuna's `device=local_rank`, torchgpipe's `devices`): `cpu`, or `cuda`
//! with the ordinal of the rank on its machine.

use candle_core::Device;

use crate::{invalid, Result};

/// The device called `name` (`cpu`, `cuda`, or `cuda:N`), with `ordinal` for a bare `cuda`
/// (a rank's local rank). Asking for CUDA from a build without it, or a GPU that is not
/// there, is an error that names the device and says what to do.
pub fn device(name: &str, ordinal: usize) -> Result<Device> {
    let (kind, index) = match name.split_once(':') {
        Some((k, i)) => {
            let i = i.parse::<usize>().map_err(|_| {
                invalid!("device `{name}`: `{i}` is not a device ordinal (use cuda:0, cuda:1, ...)")
            })?;
            (k, i)
        }
        None => (name, ordinal),
    };
    match kind {
        "cpu" => Ok(Device::Cpu),
        "cuda" if !candle_core::utils::cuda_is_available() => Err(invalid!(
            "device `{name}`: this build of pipewright has no CUDA support: rebuild with the \
             `cuda` feature, or use the cpu device"
        )),
        "cuda" => Device::new_cuda(index)
            .map_err(|e| invalid!("device `{name}`: CUDA device {index} cannot be opened: {e}")),
        _ => Err(invalid!("unknown device `{name}`: use cpu, cuda or cuda:N")),
    }
}

#[cfg(test)]
mod tests {
    use super::device;

    #[test]
    fn names_resolve_or_say_what_is_wrong() {
        assert!(device("cpu", 3).unwrap().is_cpu());
        let e = device("tpu", 0).unwrap_err().to_string();
        assert!(e.contains("unknown device `tpu`"), "{e}");
        let e = device("cuda:x", 0).unwrap_err().to_string();
        assert!(e.contains("not a device ordinal"), "{e}");
        if !candle_core::utils::cuda_is_available() {
            let e = device("cuda", 0).unwrap_err().to_string();
            assert!(e.contains("no CUDA support"), "{e}");
        }
    }
}
