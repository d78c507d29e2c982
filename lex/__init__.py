"""The `lex` command line and the tools around the model: training, evaluation, the study, export."""
