"""Images in (vLLM's multimodal interface) for the vision-language families (models/qwen2_vl.py):
prompt processing (processor.py), what a request carries (inputs.py), the runner's side (runner.py)."""
