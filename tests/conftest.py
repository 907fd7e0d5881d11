import os
import sys
from pathlib import Path

# Tests import the packages from the checkout, whatever the working directory.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
