terraform {
  required_version = ">= 1.5.0"

  required_providers {
    aws = {
      source  = "hashicorp/aws"
      version = ">= 5.40, < 7.0"
    }
  }
}

provider "aws" {
  region = var.region

  default_tags {
    tags = var.tags
  }
}

# Used only when replica_region is set; it must still be a valid region otherwise.
provider "aws" {
  alias  = "replica"
  region = coalesce(var.replica_region, var.region)

  default_tags {
    tags = var.tags
  }
}
