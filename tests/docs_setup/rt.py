# After tiny.py: a runtime, and a model and optimizer set up on it, as a fragment assumes.
rt = ddpkit.init(seed=0, out_dir="runs/docs", checkpoint_dir="runs/docs/checkpoints")
net = model = MyNet()
optimizer = opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
loss_fn = F.cross_entropy
