"""Reads a pipewright run directory with TensorBoard's own event reader and prints what it
sees: the scalar tags with their step counts, the images (tag, count, size), and the
hyperparameters of the hparams plugin. Exits non-zero when the scalars, an image or the
hparams are missing. Needs the reference venv with tensorboard (`pip install tensorboard` in
the venv of ../shared/tools/torch-env.sh); not used by CI.

    python tools/check_tensorboard.py runs/adder
"""
import io
import sys

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.hparams import plugin_data_pb2

run = sys.argv[1]
acc = EventAccumulator(run, size_guidance={"images": 0, "scalars": 0, "tensors": 0})
acc.Reload()
tags = acc.Tags()
for t in tags["scalars"]:
    print(f"scalar {t}: {len(acc.Scalars(t))} steps")
images = 0
for t in tags["images"]:
    for e in acc.Images(t):
        images += 1
        print(f"image {t} at {e.step}: {e.width}x{e.height}, {len(e.encoded_image_string)} PNG bytes")
content = acc.PluginTagToContent("hparams")
hparams = {}
for tag, raw in content.items():
    data = plugin_data_pb2.HParamsPluginData.FromString(raw)
    for k, v in data.session_start_info.hparams.items():
        hparams[k] = v.WhichOneof("kind") and getattr(v, v.WhichOneof("kind"))
print(f"hparams: {len(hparams)}: " + ", ".join(f"{k}={v}" for k, v in sorted(hparams.items())[:8]) + " ...")
ok = bool(tags["scalars"]) and images > 0 and bool(hparams)
sys.exit(0 if ok else 1)
