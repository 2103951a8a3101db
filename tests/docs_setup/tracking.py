# Trackers that write to this folder only: W&B offline, MLflow into a local store.
os.environ["WANDB_MODE"] = "offline"
os.environ["WANDB_SILENT"] = "true"
os.environ["MLFLOW_TRACKING_URI"] = "sqlite:///" + os.path.abspath("mlflow.db")
