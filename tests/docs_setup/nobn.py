# After rt.py: a model without BatchNorm (fsdp refuses running statistics that would stay per rank).
net = model = nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
