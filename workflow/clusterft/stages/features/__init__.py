"""Stage `features` (workflow/rules/features.smk): per-example features cheaper than score's
gradients, in score's file format: the base model's mean hidden state and TF-IDF of the text
(`representations`), and S2L's loss trajectories (`trajectories`)."""
