"""Loads a `pipewright ckpt export --format hf-gpt2` directory with Hugging Face transformers and
checks that every exported tensor is the model's. Usage (the venv of ../shared/tools/torch-env.sh
plus `pip install transformers`): python tools/check_hf_export.py DIR"""
import sys, torch, json
from safetensors.torch import load_file
from transformers import GPT2LMHeadModel
d = sys.argv[1]
model = GPT2LMHeadModel.from_pretrained(d)
model.eval()
sd = load_file(d + "/model.safetensors")
ms = model.state_dict()
for k, v in sd.items():
    assert torch.equal(ms[k], v), k
print("loaded", sum(p.numel() for p in model.parameters()), "parameters; every exported tensor equals the model's")
ids = torch.tensor([[1, 2, 3, 4, 5, 6]])
print("logits", model(ids).logits.shape)
