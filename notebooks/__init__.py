"""The Colab notebook and its helpers (colab.py); a package, so that `from notebooks import colab`
finds this one before any other `notebooks` on the path."""
