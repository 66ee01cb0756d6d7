"""Hugging Face causal-LM integration: models, calibration data, evaluation and layer capture.

Needs the ``llm`` extra (``pip install 'sparseswaps-prune[llm]'``); zero-shot evaluation also the ``eval`` extra.
The modules import transformers and the other optional packages only inside the functions that use them, each
behind :func:`sparseswaps_prune.extras.require`, so a missing package is named with the extra to install.
"""
