"""Vision towers of the vision-language families (models/qwen2_vl.py) and their configs."""
