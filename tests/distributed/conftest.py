import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))  # ranks.py, the per-rank script, is also imported by the tests
