"""One package per numbered notebook (construction, elicitation, evaluation, finetune, probes,
transfer, agent, report, verify). Imports the layers below it (and other stages)."""
