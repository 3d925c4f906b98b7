"""Analyses of an ensemble's members: tokenizer agreement (GaC Fig. 2) and calibration (GaC Tab. 1)."""
