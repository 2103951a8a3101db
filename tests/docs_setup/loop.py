# After rt.py: the model and optimizer set up, a loader and the state a checkpoint keeps.
model, opt = rt.setup(model, opt)
optimizer = opt
loader = train = rt.loader(train_set, global_batch_size=32, shuffle=True)
state = {"model": model, "optimizer": opt}
