"""The decode-attention module as shipped before this session (git 976525f), imported from a temporary file:
the archive keeps no copy of it. Needs a clone with git."""
import importlib.util, subprocess, tempfile

COMMIT, PATH = "976525f", "src/mlx_grpo/models/decode_attention.py"


def previous_attention():
    source = subprocess.run(["git", "show", f"{COMMIT}:{PATH}"], capture_output=True, text=True, check=True).stdout
    with tempfile.NamedTemporaryFile("w", suffix="_attn_prev.py", delete=False) as f:
        f.write(source)
    spec = importlib.util.spec_from_file_location("attn_prev", f.name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
