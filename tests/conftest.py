import os
import sys

# Tests share helper modules (hf_utils, attention_refs) and import the repo's top-level packages.
sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))
