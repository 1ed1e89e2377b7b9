"""The in-process experiment runner and its reports (FedDualAtt's Table I and head-ratio ablation)."""
