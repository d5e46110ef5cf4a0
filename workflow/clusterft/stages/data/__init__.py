"""Stage `data` (workflow/rules/data.smk): the instruction pools and their benchmark items
(`prepare`), the general corpus for the tokenizer and pretraining (`corpus`), and the
contamination check of every pool against every task (`decontaminate`)."""
