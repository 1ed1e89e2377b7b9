"""The FedDualAtt network and what is derived from it.

network (DualAttentionResNet1D and the plain ResNet1D-34), architecture, partition (theta^g and phi_k),
export (a standalone file). Import from the modules.
"""
