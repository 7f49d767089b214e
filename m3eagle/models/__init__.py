"""The models as MiniMax-M3 defines them: the target (`minimax_m3.py`), the Eagle3 head (`eagle3.py`) and shared
layers; forwards run the ops that come with each step."""
